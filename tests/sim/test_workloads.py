"""Scenarios: deterministic from their seed, sharing what they say they share."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, cast

import numpy as np
import pytest

from prefixroute import BlockHasher
from prefixroute.errors import ConfigurationError, InvalidPromptError, InvalidTypeError
from prefixroute.sim.request import SimRequest, token_bytes
from prefixroute.sim.workloads import make_workload, scenario_names


def _draw(name: str, n: int, *, seed: int = 0, sharing_ratio: float | None = None) -> list[SimRequest]:
    workload = make_workload(name, seed=seed, sharing_ratio=sharing_ratio)
    requests = [workload.next_request(i % 30) for i in range(n)]
    assert all(r is not None for r in requests)
    return [r for r in requests if r is not None]


@pytest.mark.parametrize("name", scenario_names())
def test_scenarios_are_deterministic(name: str) -> None:
    assert _draw(name, 50, seed=4) == _draw(name, 50, seed=4)
    assert _draw(name, 50, seed=4) != _draw(name, 50, seed=5)


def test_seed_scenario_shape() -> None:
    requests = _draw("seed", 2000)
    tags = Counter(r.tag for r in requests)
    assert set(tags) == {"prefix0", "prefix1", "prefix2", "prefix3", "unique"}
    assert 0.87 < 1 - tags["unique"] / len(requests) < 0.93
    assert all(80 <= r.output_tokens <= 120 for r in requests)
    hasher = BlockHasher(16)
    by_prefix: dict[str, set[int]] = {}
    for r in requests[:200]:
        if r.tag != "unique":
            first = hasher.hash(r.prompt)[0]
            by_prefix.setdefault(r.tag, set()).add(first)
    assert all(len(firsts) == 1 for firsts in by_prefix.values())  # one shared prefix per tag
    lengths = {tag: min(r.prompt_tokens for r in requests if r.tag == tag) for tag in by_prefix}
    assert lengths["prefix0"] >= 2048 + 100 and lengths["prefix3"] >= 8192 + 100


def test_sharing_ratio_knob() -> None:
    for ratio in (0.1, 0.5):
        requests = _draw("seed", 2000, sharing_ratio=ratio)
        shared = sum(r.tag != "unique" for r in requests) / len(requests)
        assert abs(shared - ratio) < 0.04
    with pytest.raises(ConfigurationError, match="between 0 and 1"):
        make_workload("seed", sharing_ratio=1.5)


def test_hot_prefix_share() -> None:
    tags = Counter(r.tag for r in _draw("hot-prefix", 2000))
    assert 0.77 < tags["hot"] / 2000 < 0.83


def test_multi_turn_prompts_extend_the_previous_turn() -> None:
    workload = make_workload("multi-turn", seed=2)
    first = workload.next_request(7)
    second = workload.next_request(7)
    assert first is not None and second is not None and first.output is not None
    if second.prompt.startswith(first.prompt):  # same session: the previous prompt and answer lead the new one
        assert second.prompt.startswith(first.prompt + first.output)


def test_rag_top_documents_follow_zipf() -> None:
    tags = Counter(r.tag for r in _draw("rag", 3000))
    assert tags.most_common(1)[0][0] == "doc0"
    assert tags["doc0"] > tags.get("doc10", 0) * 3


def test_unknown_scenario() -> None:
    with pytest.raises(ConfigurationError, match="unknown scenario 'nope'; choose one of seed"):
        make_workload("nope")


def test_system_prompt_scenario_shares_one_long_prefix_then_grows_each_conversation() -> None:
    workload = make_workload("system-prompt", seed=3)
    hasher = BlockHasher(16)
    system_blocks = 4096 // 16
    requests = [(user, workload.next_request(user)) for _ in range(6) for user in range(20)]
    first_blocks = set()
    previous: dict[int, SimRequest] = {}
    extended = 0
    for user, request in requests:
        assert request is not None and request.output is not None
        hashes = hasher.hash(request.prompt)
        assert len(hashes) > system_blocks  # the system prompt, then the conversation
        first_blocks.add(tuple(hashes[:system_blocks]))
        before = previous.get(user)
        if before is not None and before.output is not None and request.prompt.startswith(before.prompt):
            assert request.prompt.startswith(before.prompt + before.output)  # history grows by answer + message
            extended += 1
        previous[user] = request
    assert len(first_blocks) == 1  # every request of every user opens with the same 4,096 tokens
    assert extended >= 60  # most turns continue their conversation (2–8 turns per session)
    fresh = make_workload("system-prompt", seed=3, sharing_ratio=0.0).next_request(0)
    assert fresh is not None and hasher.hash(fresh.prompt)[0] not in {blocks[0] for blocks in first_blocks}


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"prompt": None}, InvalidTypeError, "SimRequest prompt must be bytes"),
        ({"prompt": [1, 2]}, InvalidTypeError, "SimRequest prompt must be bytes .*, not list"),
        ({"prompt": b""}, InvalidPromptError, "prompt must be non-empty"),
        ({"prompt": b"\x01\x00\x00"}, InvalidPromptError, "a multiple of 4 bytes"),
        ({"output_tokens": 0}, ConfigurationError, "output_tokens must be an int >= 1, not 0"),
        ({"output_tokens": 2.0}, ConfigurationError, "output_tokens must be an int >= 1, not 2.0"),
        ({"output_tokens": None}, ConfigurationError, "output_tokens must be an int >= 1, not None"),
        ({"output": "ab"}, InvalidTypeError, "SimRequest output must be bytes"),
        ({"output": b"\x00" * 4}, ConfigurationError, r"output must hold exactly output_tokens \(2\) token ids"),
        ({"arrival": -1.0}, ConfigurationError, "arrival must be a finite number of seconds >= 0 or None, not -1.0"),
        ({"arrival": float("nan")}, ConfigurationError, "arrival must be"),
        ({"arrival": "0"}, ConfigurationError, "arrival must be"),
        ({"tag": None}, InvalidTypeError, "SimRequest tag must be a str, not NoneType"),
    ],
)
def test_a_sim_request_names_the_field_it_cannot_take(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    good: dict[str, Any] = {"prompt": b"\x01\x00\x00\x00" * 3, "output_tokens": 2}
    SimRequest(**good)
    with pytest.raises(error, match=message):
        SimRequest(**{**good, **fields})


def test_a_sim_request_keeps_numpy_figures_as_plain_numbers() -> None:
    request = SimRequest(b"\x01\x00\x00\x00", cast(int, np.int64(3)), arrival=cast(float, np.float32(1.5)))
    assert type(request.output_tokens) is int and request.output_tokens == 3
    assert type(request.arrival) is float and request.arrival == 1.5


@pytest.mark.parametrize(
    ("start", "count", "error"),
    [(None, 1, InvalidTypeError), (0, 1.0, InvalidTypeError), (-1, 1, InvalidPromptError),
     (0, -1, InvalidPromptError), (2**32 - 1, 2, InvalidPromptError)],
)  # fmt: skip
def test_token_bytes_refuses_runs_outside_the_uint32_ids(start: Any, count: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        token_bytes(start, count)
    assert token_bytes(2**32 - 2, 2) == (2**32 - 2).to_bytes(4, "little") + (2**32 - 1).to_bytes(4, "little")


def test_a_scenario_s_pieces_refuse_what_is_no_token_count() -> None:
    # Scenario's piece() and unique() are the helpers a scenario of one's own builds prompts from: a key or length
    # they cannot use is a ConfigurationError naming both, never a TypeError from a comparison or an empty prompt.
    scenario = make_workload("seed", seed=0)
    assert scenario.piece(cast(int, np.int64(3)), 4) == scenario.piece(3, 4) == token_bytes(3 * 2**19, 4)
    assert scenario.piece(2047, 2**19) == token_bytes(2047 * 2**19, 2**19)
    for key, length in (("a", 4), (2048, 4), (-1, 4), (0, 0), (0, 2**19 + 1), (0, 1.5), (True, 4)):
        with pytest.raises(ConfigurationError, match=r"^a shared piece is an int key in \[0, 2048\) of an int length"):
            scenario.piece(key, length)  # type: ignore[arg-type]
    assert len(scenario.unique(cast(int, np.int64(5)))) == 4 * 5
    for bad in (0, -3, "5", 2.0, 2**30 + 1):
        with pytest.raises(ConfigurationError, match=r"^a unique piece is an int length in \[1, 1073741824\] tokens"):
            scenario.unique(bad)  # type: ignore[arg-type]


def _span(values: list[int]) -> tuple[int, int]:
    return min(values), max(values)


def test_each_scenario_draws_the_whole_documented_range_and_nothing_outside_it() -> None:
    # docs/simulator.md's table and each scenario's docstring: many draws reach both ends of every range.
    hot = _draw("hot-prefix", 4000)
    assert _span([r.prompt_tokens - 4096 for r in hot]) == (100, 400)
    assert _span([r.output_tokens for r in hot]) == (80, 120)
    assert sorted(Counter(r.tag for r in hot)) == ["hot"] + [f"prefix{k}" for k in range(1, 9)]
    seed = [r for r in _draw("seed", 4000) if r.tag == "prefix0"]
    assert _span([r.prompt_tokens - 2048 for r in seed]) == (100, 400)
    rag = _draw("rag", 4000)
    assert _span([r.prompt_tokens - 512 - 3 * 1024 for r in rag]) == (50, 150)
    assert {r.output_tokens for r in rag} == {150}
    first_document = 1 / sum(1 / rank**1.1 for rank in range(1, 201))  # Zipf 1.1 over 200 documents
    assert abs(Counter(r.tag for r in rag)["doc0"] / len(rag) - first_document) < 0.02
    shared = _draw("shared-prefix", 2000)
    assert {(r.prompt_tokens, r.output_tokens) for r in shared} == {(2048 + 128, 256)}
    assert len({r.tag for r in shared}) == 64 and len({r.prompt for r in shared}) <= 64 * 16
    by_group: dict[str, set[bytes]] = {}
    for request in shared:
        by_group.setdefault(request.tag, set()).add(request.prompt)
    assert max(len(prompts) for prompts in by_group.values()) == 16  # 16 questions per group, each recurring


def test_multi_turn_sessions_run_two_to_eight_turns_of_the_documented_sizes() -> None:
    workload = make_workload("multi-turn", seed=0)
    turns: list[int] = []
    messages: list[int] = []
    outputs: list[int] = []
    previous: SimRequest | None = None
    for _ in range(3000):
        request = workload.next_request(0)
        assert request is not None and request.output is not None and request.tag == "session0"
        if (
            previous is not None
            and previous.output is not None
            and request.prompt.startswith(previous.prompt + previous.output)
        ):
            turns[-1] += 1
            messages.append(request.prompt_tokens - previous.prompt_tokens - previous.output_tokens)
        else:
            assert request.prompt.startswith(token_bytes(0, 1024))  # the shared system prompt opens a session
            turns.append(1)
            messages.append(request.prompt_tokens - 1024)
        outputs.append(request.output_tokens)
        previous = request
    assert _span(turns[:-1]) == (2, 8)  # the last session may be cut short
    assert _span(messages) == (50, 300) and _span(outputs) == (100, 300)


@pytest.mark.parametrize("name", scenario_names())
def test_every_scenario_takes_its_sharing_ratio(name: str) -> None:
    hasher = BlockHasher(16)
    for ratio, shares in ((0.0, False), (1.0, True)):
        workload = make_workload(name, seed=0, sharing_ratio=ratio)
        requests = [workload.next_request(user) for user in range(60)]  # for chats: 60 sessions' first turns
        first_blocks = Counter(hasher.hash(r.prompt)[0] for r in requests if r is not None)
        # Shared material leads with a piece many prompts start with; all-unique prompts start each their own.
        assert (first_blocks.most_common(1)[0][1] > 1) is shares, (name, ratio)


def test_unique_pieces_never_overlap_each_other_or_the_shared_pieces() -> None:
    scenario = make_workload("seed", seed=0)
    runs = []
    for length in (300, 100, 500, 1, 200):  # a longer piece after a shorter one: where a wrong cursor overlaps
        ids = np.frombuffer(scenario.unique(length), dtype="<u4")
        assert len(ids) == length and (np.diff(ids.astype(np.int64)) == 1).all()
        runs.append((int(ids[0]), int(ids[-1]) + 1))
    assert all(start >= 2**30 for start, _ in runs)  # above every shared piece (2,048 pieces of 2**19 ids)
    runs.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(runs))
