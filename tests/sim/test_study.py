"""``prefixroute study``: every section written, every verdict computed from the figures by one table of rules."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from prefixroute import BoundedLoad, Decision, Router
from prefixroute.cli import main
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.profiles import load_profile
from prefixroute.sim.runner import SimSpec, run_policy
from prefixroute.sim.study import run_study
from prefixroute.sim.study import runs as study_runs
from prefixroute.sim.study.claims import CLAIMS, PUBLISHED, Check, Claim, Rule, judge, verdict_of
from prefixroute.sim.study.render import render
from prefixroute.sim.study.runs import StudyRuns, measure_route_ms, run_all

VERDICTS = ("reproduced", "direction only", "not reproduced")


@pytest.fixture(scope="module")
def heard_and_runs() -> tuple[list[str], StudyRuns]:
    heard: list[str] = []
    return heard, run_all(40, heard.append)


@pytest.fixture(scope="module")
def runs(heard_and_runs: tuple[list[str], StudyRuns]) -> StudyRuns:
    return heard_and_runs[1]


def test_study_writes_every_section(tmp_path: Path) -> None:
    assert main(["study", "--output", str(tmp_path), "--requests", "40"]) == 0
    text = (tmp_path / "study.md").read_text()
    for number in range(1, 9):
        assert f"## {number}. " in text
    for claim in CLAIMS:
        assert claim.statement in text
    for image in ("study-seed.png", "study-sweeps.png"):
        assert f"]({image})" in text
        assert (tmp_path / image).read_bytes()[:4] == b"\x89PNG"
    assert "40 requests per run, 41 runs" in text


def test_runs_cover_every_section(runs: StudyRuns) -> None:
    assert len(runs.all) == 41
    assert set(runs.seed) == {"round-robin", "prefix-affinity", "bounded-load"}
    assert all(len(by_factor) == 5 for by_factor in runs.hot_bounded.values())
    assert runs.route_ms > 0 and runs.decode_step_ms > 0
    for miss, hit in runs.prefill_ms.values():
        assert 0 < hit < miss


def test_every_verdict_on_the_page_is_computed(runs: StudyRuns, tmp_path: Path) -> None:
    judged = judge(CLAIMS, runs)
    assert {j.verdict for j in judged} <= set(VERDICTS)
    assert len(judged) == sum(len(c.checks) for c in CLAIMS)
    page = render(runs, judged, tmp_path)
    for claim in CLAIMS:
        assert f"| {claim.statement} | **{verdict_of(judged, claim)}** |" in page
    # Move one published figure to what was simulated: its verdict, and only its, follows.
    first = judged[0]
    moved = dataclasses.replace(first.check, published=first.simulated)
    claim = dataclasses.replace(first.claim, checks=(moved,))
    assert judge([claim], runs)[0].verdict == "reproduced"
    far = dataclasses.replace(first.check, published=first.simulated * 10)
    assert judge([dataclasses.replace(first.claim, checks=(far,))], runs)[0].verdict != "reproduced"


def _judge(rule: Rule, published: float, simulated: float, no_effect: float | None = None) -> str:
    check = Check("x", published, lambda _runs: simulated, rule, "×", no_effect)
    return judge([Claim(0, "claim", (check,))], StudyRuns(requests=1))[0].verdict


@pytest.mark.parametrize(
    ("rule", "published", "simulated", "no_effect", "verdict"),
    [
        (Rule.FACTOR, 0.15, 0.16, 1.0, "reproduced"),
        (Rule.FACTOR, 0.15, 0.22, 1.0, "reproduced"),  # within 1.5x
        (Rule.FACTOR, 0.15, 0.5, 1.0, "direction only"),  # below 1, but more than 1.5x away
        (Rule.FACTOR, 0.15, 1.2, 1.0, "not reproduced"),  # the other side of "no effect"
        (Rule.FACTOR, 36.3, 3.4, None, "not reproduced"),
        (Rule.FACTOR, 85.0, -3.0, 0.0, "not reproduced"),
        (Rule.POINTS, 91.0, 87.0, None, "reproduced"),
        (Rule.POINTS, 91.0, 80.0, None, "not reproduced"),
        (Rule.AT_LEAST, 36.0, 57.0, 0.0, "reproduced"),
        (Rule.AT_LEAST, 45.0, 12.0, 0.0, "direction only"),
        (Rule.AT_LEAST, 45.0, -5.0, 0.0, "not reproduced"),
        (Rule.AT_MOST, 0.0, 0.0, None, "reproduced"),
        (Rule.AT_MOST, 0.0, 1.0, None, "not reproduced"),
        (Rule.AT_MOST, 1.0, math.nan, None, "not reproduced"),
    ],
)
def test_rules(rule: Rule, published: float, simulated: float, no_effect: float | None, verdict: str) -> None:
    assert _judge(rule, published, simulated, no_effect) == verdict


def test_published_figures_live_in_one_table() -> None:
    # Every check's published value is one of PUBLISHED's figures or derived from them (no number retyped).
    values = set(PUBLISHED.values())
    derived = {100 * v for v in values} | {0.0, 1.0, 100.0}  # the bounds of "no effect" and "all of it"
    derived |= {PUBLISHED["prefix-aware P99 TTFT ms"] / PUBLISHED["round-robin P99 TTFT ms"]}
    derived |= {PUBLISHED["prefix-aware req/s"] / PUBLISHED["round-robin req/s"]}
    derived |= {100 * (PUBLISHED["prefix-aware hit rate"] - PUBLISHED["round-robin hit rate"])}
    for claim in CLAIMS:
        for check in claim.checks:
            assert check.published in values | derived, check.figure


def test_run_study_takes_a_str_folder(tmp_path: Path) -> None:
    # Was: AttributeError ('str' object has no attribute 'exists'), the public function's only argument.
    path = run_study(str(tmp_path / "study"), requests=3)
    assert path == tmp_path / "study" / "study.md" and path.is_file()


@pytest.mark.parametrize(
    ("out", "options", "error", "message"),
    [
        (None, {}, InvalidTypeError, "out must be a folder (a str or a path), not NoneType"),
        (5, {}, InvalidTypeError, "out must be a folder (a str or a path), not int"),
        ("", {}, ConfigurationError, "out must name a folder, not ''"),
        ("  ", {}, ConfigurationError, "out must name a folder, not '  '"),
        ("a\0b", {}, ConfigurationError, "out 'a\\x00b': a path cannot hold a NUL byte"),
        # Was: TypeError ('NoneType' object is not callable) once the folder was made and the first run began.
        ("study", {"progress": None}, InvalidTypeError, "progress must be callable, not NoneType"),
        ("study", {"progress": "log"}, InvalidTypeError, "progress must be callable, not str"),
    ],
)
def test_run_study_refuses_bad_arguments_before_any_work(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    out: object,
    options: dict[str, object],
    error: type[Exception],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as raised:
        run_study(out, requests=3, **options)  # type: ignore[arg-type]
    assert str(raised.value) == message
    assert list(tmp_path.iterdir()) == []  # nothing written, not even into the current folder


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        (0, "requests must be an int in [1, 100,000,000], not 0"),
        (10**13, "requests must be an int in [1, 100,000,000], not 10000000000000"),
        (2.5, "requests must be an int in [1, 100,000,000], not 2.5"),
    ],
)
def test_run_study_names_the_keyword_a_caller_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requests: object, message: str
) -> None:
    # Was: "--requests must be ...", "--output ... is not a folder": options of a command line the caller never used.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as raised:
        run_study("study", requests=requests)  # type: ignore[arg-type]
    assert str(raised.value) == message
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError) as raised:
        run_study("file", requests=3)
    assert str(raised.value) == "out file is not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("name", ["study.md", "study-seed.png", "study-sweeps.png"])
def test_an_output_file_that_cannot_be_written_fails_before_the_runs(tmp_path: Path, name: str) -> None:
    # Was: all 41 simulations ran first (a minute or more at the default --requests), the plots before the blocked
    # file were written, and only then did the write fail.
    (tmp_path / name).mkdir()
    heard: list[str] = []
    with pytest.raises(ConfigurationError, match=f"^out {re.escape(str(tmp_path / name))} is a folder"):
        run_study(tmp_path, requests=3, progress=heard.append)
    assert heard == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_cli_an_output_file_that_cannot_be_written_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "study.md").mkdir()
    assert main(["study", "--output", str(tmp_path), "--requests", "3"]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == f"prefixroute study: error: --output {tmp_path / 'study.md'} is a folder: give a file path\n"
    )


def test_cli_an_output_folder_that_cannot_be_created_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was "prefixroute study: error: Not a directory: ..." from the generic handler, naming no option.
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "study"
    assert main(["study", "--output", str(folder), "--requests", "3"]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == f"prefixroute study: error: --output {folder}: cannot create the folder (Not a directory)\n"
    )


def test_each_run_is_announced_and_labelled_by_section(heard_and_runs: tuple[list[str], StudyRuns]) -> None:
    heard, runs = heard_and_runs
    labels = [f"{section}: {result.policy}" for section, result in runs.all]
    assert heard == labels
    assert labels[:5] == [
        "8-GPU table: round-robin",
        "8-GPU table: prefix-affinity",
        "8-GPU table: bounded-load",
        "prefix length: round-robin 2048",
        "prefix length: bounded-load 2048",
    ]
    assert "model size: bounded-load codellama-34b" in labels and "sharing ratio: round-robin 0.5" in labels
    assert labels[-1] == "hot prefix: bounded-load 4× (open loop 3 req/s)"


def test_each_sweep_runs_what_it_names(runs: StudyRuns) -> None:
    # Prefix length: a longer shared prefix makes longer prompts (prompt tokens per request).
    mean_prompt = [rr.prompt_tokens_per_s / rr.throughput_rps for rr, _bl in runs.lengths.values()]
    assert list(runs.lengths) == [2048, 4096, 8192, 16384]
    assert all(shorter < longer for shorter, longer in zip(mean_prompt, mean_prompt[1:], strict=False))
    assert mean_prompt[0] > 2048 and mean_prompt[-1] > 16384 * 0.5
    # Model size: each model's own engines (tp and KV capacity from its profile on a100-80gb).
    for model in runs.models:
        profile = load_profile(model, "a100-80gb")
        assert runs.tp[model] == profile.tp
        assert runs.kv_tokens[model] > 0 and runs.kv_tokens[model] % 16 == 0  # whole blocks
    assert len(set(runs.kv_tokens.values())) == len(runs.models)
    assert runs.kv_bytes_ratio_13b_8b == pytest.approx(
        load_profile("codellama-13b", "a100-80gb").kv_bytes_per_token
        / load_profile("llama-3-8b", "a100-80gb").kv_bytes_per_token
    )
    # The profile's figures in milliseconds: a miss computes the whole prompt, a hit its last 100 tokens.
    profile = load_profile("codellama-13b", "a100-40gb")
    for length, (miss, hit) in runs.prefill_ms.items():
        assert miss == pytest.approx(1000 * profile.prefill_seconds(length, 0))
        assert hit == pytest.approx(1000 * profile.prefill_seconds(100, length - 100))
    assert runs.decode_step_ms == pytest.approx(1000 * profile.step_seconds([], [5000] * 4))


def test_the_sharing_and_fallback_sweeps_are_the_simulate_runs_they_name(runs: StudyRuns) -> None:
    # §5 is `prefixroute simulate --sharing-ratio R` (scenario seed, seed 0) and §6 bounded-load at each factor on
    # hot-prefix: a reader reruns a row with those settings and gets the same figures.
    for ratio in (0.1, 0.7):
        spec = SimSpec(requests=runs.requests, sharing_ratio=ratio, seed=0)
        for policy, result in zip(("round-robin", "bounded-load"), runs.sharing[ratio], strict=True):
            assert run_policy(spec, policy, label=result.policy) == result, (ratio, policy)
    spec = SimSpec(scenario="hot-prefix", requests=runs.requests)
    for factor in (1.25, 4.0):
        result = runs.hot_bounded["closed loop"][factor]
        assert run_policy(spec, functools.partial(BoundedLoad, factor=factor), label=result.policy) == result, factor


def test_run_study_makes_a_nested_folder_and_runs_at_one_request(tmp_path: Path) -> None:
    path = run_study(tmp_path / "a" / "b", requests=1)
    text = path.read_text(encoding="utf-8")
    assert path == tmp_path / "a" / "b" / "study.md"
    assert "1 requests per run, 41 runs" in text
    # Was: "|\n\n", a blank line at the end of a generated page (git diff and editors flag it).
    assert text.endswith("|\n") and not text.endswith("\n\n")


def _batch_clock(durations: list[float]) -> Callable[[], float]:
    """A clock read twice a batch (before, after) on which batch k takes ``durations[k]`` seconds."""
    readings, now = [], 0.0
    for duration in durations:
        readings += [now, now + duration]
        now += duration
    return iter(readings).__next__


def test_route_time_is_the_median_batch_of_new_8k_prompts_over_8_backends_warm_up_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What §4 reports as "route() of an 8K-token prompt over 8 backends, measured in this run (median)".
    routed: list[tuple[bytes, tuple[str, ...]]] = []

    class Recording(Router):
        def route(self, prompt_tokens: Any, backends: Sequence[str], **options: Any) -> Decision:
            routed.append((bytes(prompt_tokens), tuple(backends)))
            return super().route(prompt_tokens, backends, **options)

    monkeypatch.setattr(study_runs, "Router", Recording)
    # 8 batches of 50: the warm-up takes 100 s, the others 1 to 7 s, whose median is 4 s, 80 ms a route.
    assert measure_route_ms(clock=_batch_clock([100.0, 7.0, 1.0, 6.0, 2.0, 5.0, 3.0, 4.0])) == pytest.approx(80.0)
    assert len(routed) == 8 * 50
    assert {len(prompt) for prompt, _ in routed} == {4 * 8192}  # uint32 token ids
    assert len({prompt for prompt, _ in routed}) == len(routed)  # each prompt new: no prefix cached
    assert {backends for _, backends in routed} == {tuple(f"gpu{i}" for i in range(8))}
    routed.clear()
    assert measure_route_ms(tokens=32, backends=2, repeats=2, batch=4, clock=_batch_clock([9.0, 2.0, 4.0])) == (
        pytest.approx(1000 * 3.0 / 4)
    )
    assert len(routed) == 3 * 4 and {len(prompt) for prompt, _ in routed} == {4 * 32}
