"""Trace readers: the formats, the token construction, and errors that name the bad line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixroute import BlockHasher
from prefixroute.errors import InvalidTraceError
from prefixroute.sim.traces import (
    load_trace,
    mooncake_tokens,
    read_azure,
    read_burstgpt,
    read_mooncake,
    read_splitwise,
)


def _line(**fields: object) -> str:
    item: dict[str, object] = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    item.update(fields)
    return json.dumps(item)


def test_mooncake_tokens_share_exactly_the_shared_hash_ids() -> None:
    hasher = BlockHasher(16)
    a = hasher.hash(mooncake_tokens([4, 9, 11], 1300))
    b = hasher.hash(mooncake_tokens([4, 9, 12], 1400))
    c = hasher.hash(mooncake_tokens([5, 9, 11], 1300))
    assert len(mooncake_tokens([4, 9, 11], 1300)) == 4 * 1300
    shared = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    assert shared == 2 * 512 // 16  # the first two 512-token blocks, and nothing after
    assert not set(a) & set(c)  # a different first block: nothing shared, even though later ids agree


def test_read_mooncake_parses_and_converts_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line() + "\n\n" + _line(timestamp=1500, hash_ids=[1, 3]) + "\n")
    entries = read_mooncake(path)
    assert [e.arrival for e in entries] == [0.0, 1.5]
    assert entries[1].hash_ids == (1, 3)
    workload = load_trace(f"mooncake:{path}")
    first = workload.next_request(0)
    assert first is not None and first.prompt_tokens == 600 and first.output_tokens == 5
    assert workload.next_request(0) is not None and workload.next_request(0) is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0}', "missing field"),
        (_line(hash_ids=[1]), "expected ceil"),
        (_line(input_length=0), "input_length"),
        (_line(output_length="5"), "output_length"),
        (_line(timestamp=-1), "timestamp"),
        (_line(timestamp=10**400), "timestamp must be a non-negative number of ms, not an int of"),
        (_line(hash_ids=[1, -2]), "hash_ids"),
    ],
)
def test_malformed_mooncake_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_line() + "\n" + line + "\n")
    with pytest.raises(InvalidTraceError, match=rf"bad\.jsonl:2: .*{message}"):
        read_mooncake(path)


def test_read_splitwise_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,7\n0.5,40,3\n")
    entries = read_splitwise(path)
    assert [(e.arrival, e.input_length, e.output_length) for e in entries] == [(0.0, 100, 7), (0.5, 40, 3)]
    workload = load_trace(f"splitwise:{path}", seed=1)
    a, b = workload.next_request(0), workload.next_request(0)
    assert a is not None and b is not None and a.prompt_tokens == 100
    assert not set(BlockHasher(16).hash(a.prompt)) & set(BlockHasher(16).hash(b.prompt))
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,7\n0.1,x,3\n")
    with pytest.raises(InvalidTraceError, match=r"s\.csv:3:"):
        read_splitwise(path)
    path.write_text("time,prompt\n0,1\n")
    with pytest.raises(InvalidTraceError, match="header lacks"):
        read_splitwise(path)


def test_read_azure_dates_and_offsets(tmp_path: Path) -> None:
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"  # as published: seven fractional digits, no offset
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,0\n"
                    "2023-11-16 18:16:00,91,16\n")  # fmt: skip
    entries = read_azure(path)
    assert [e.arrival for e in entries] == pytest.approx([0.0, 4.314579, 13.31941])
    assert [(e.input_length, e.output_length) for e in entries] == [(374, 44), (396, 1), (91, 16)]
    assert len(load_trace(f"azure:{path}")) == 3
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2024-05-10 00:00:00.009930+00:00,10,2\n2024-05-10 02:00:01.5+02:00,10,2\n")  # fmt: skip
    assert [e.arrival for e in read_azure(path)] == pytest.approx([0.0, 1.490070])  # the same hour in UTC+2


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("yesterday,10,2", "expected a date and time"),
        ("2023-02-30 00:00:00,10,2", "expected a date and time"),
        ("2023-11-16 18:15:40,10,2", "after the first row's"),
        ("2023-11-16 18:15:50,0,2", r"token counts in \[1,"),
        ("2023-11-16 18:15:50,10,-1", "may be 0"),
    ],
)
def test_bad_azure_rows_name_the_line(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "a.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\n{row}\n")
    with pytest.raises(InvalidTraceError, match=rf"a\.csv:3: .*{message}"):
        read_azure(path)


def test_read_burstgpt_ignores_other_columns(tmp_path: Path) -> None:
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n45,GPT-4,1087,0,1087,API log\n")  # fmt: skip
    entries = read_burstgpt(path)
    assert [(e.arrival, e.input_length, e.output_length) for e in entries] == [(5.0, 472, 18), (45.0, 1087, 1)]
    path.write_text("Timestamp,Model,Request tokens\n5,ChatGPT,472\n")
    with pytest.raises(InvalidTraceError, match="header lacks column.s. Response tokens"):
        read_burstgpt(path)


def test_trace_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidTraceError, match="FORMAT:PATH"):
        load_trace("sharegpt:x.csv")
    with pytest.raises(InvalidTraceError, match="cannot read trace"):
        load_trace(f"mooncake:{tmp_path / 'missing.jsonl'}")


def test_shared_traces_parse(data_dir: Path) -> None:
    assert len(read_mooncake(data_dir / "mooncake-fast25" / "synthetic_trace.jsonl")) == 3993
    code = read_splitwise(data_dir / "vidur-profiling" / "processed_traces" / "splitwise_code.csv")
    assert len(code) == 8819 and all(e.input_length >= 1 for e in code)
