"""Trace readers: the formats, the token construction, and errors that name the bad line."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TextIO, cast

import numpy as np
import pytest

from prefixroute import BlockHasher
from prefixroute.errors import ConfigurationError, InvalidTraceError
from prefixroute.sim.request import SimRequest
from prefixroute.sim.traces import (
    TraceWorkload,
    check_speedup,
    load_trace,
    mooncake_tokens,
    read_azure,
    read_bailian,
    read_burstgpt,
    read_mooncake,
    read_splitwise,
)


def _line(**fields: object) -> str:
    item: dict[str, object] = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    item.update(fields)
    return json.dumps(item)


@pytest.mark.parametrize(
    ("hash_ids", "input_length", "block_tokens", "message"),
    [
        ([], 0, 512, r"hash_ids must be a non-empty sequence of ints in \[0, 8388607\], not \[\]"),
        ("ab", 600, 512, "hash_ids must be a non-empty sequence"),
        ([1, None], 600, 512, "hash_ids must be"),
        ([1, -1], 600, 512, "hash_ids must be"),
        ([2**23], 100, 512, r"in \[0, 8388607\]"),  # its block would end past token 2**32 - 1
        ([1, 2], 1025, 512, r"input_length must be an int in \[513, 1024\] for 2 hash ids of 512 tokens, not 1025"),
        ([1, 2], 512, 512, r"\[513, 1024\]"),  # the second id would name an empty block
        ([1, 2], 600.0, 512, "input_length must be an int"),
        ([1], 10, 0, "block_tokens must be an int >= 1, not 0"),
    ],
)
def test_mooncake_tokens_refuses_ids_and_lengths_a_reader_would_refuse(
    hash_ids: Any, input_length: Any, block_tokens: Any, message: str
) -> None:
    with pytest.raises(InvalidTraceError, match=message):
        mooncake_tokens(hash_ids, input_length, block_tokens=block_tokens)


def test_mooncake_tokens_takes_the_edges_of_the_last_block_and_the_top_id() -> None:
    assert len(mooncake_tokens([1, 2], 513)) == 4 * 513 and len(mooncake_tokens([1, 2], 1024)) == 4 * 1024
    assert mooncake_tokens([2**23 - 1], 512)[-4:] == (2**32 - 1).to_bytes(4, "little")
    numpy_ids, numpy_length = cast("list[int]", [np.int64(4), np.int64(9)]), cast(int, np.int64(600))
    assert mooncake_tokens(numpy_ids, numpy_length) == mooncake_tokens([4, 9], 600)


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
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"timestamp": 0}', "missing field.s. input_length, output_length, hash_ids$"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        (_line(hash_ids=[1]), r"a mooncake: trace has one per 512 tokens, ceil\(600/512\) = 2"),
        (_line(input_length=-1), "input_length"),
        (_line(input_length=True, hash_ids=[1]), r"input_length must be an int in \[0, 1048576\], not True"),
        (_line(input_length="600"), r"input_length must be an int in \[0, 1048576\], not '600'"),
        (_line(input_length=0), r"2 hash_ids for input_length 0"),
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


def _bailian(**fields: object) -> str:
    """A line as Qwen-Bailian's README specifies it: seconds, and one hash id per 16 tokens."""
    # fmt: off
    item: dict[str, object] = {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 40,
                               "output_length": 132, "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]}
    # fmt: on
    item.update(fields)
    return json.dumps(item)


def test_read_bailian_reads_seconds_and_16_token_blocks(tmp_path: Path) -> None:
    path = tmp_path / "qwen_traceA_blksz_16.jsonl"
    follow_up = _bailian(chat_id=160, parent_chat_id=159, timestamp=62.5, input_length=64, turn=2,
                         hash_ids=[1089, 1090, 1091, 6326])  # fmt: skip
    path.write_text(_bailian() + "\n" + follow_up + "\n")
    entries = read_bailian(path)
    assert [e.arrival for e in entries] == pytest.approx([0.0, 1.386])  # seconds, from the first request
    assert [e.block_tokens for e in entries] == [16, 16]
    workload = load_trace(f"bailian:{path}")
    first, second = workload.next_request(0), workload.next_request(0)
    assert first is not None and second is not None and workload.next_request(0) is None
    assert (first.prompt_tokens, first.output_tokens, second.prompt_tokens) == (40, 132, 64)
    hasher = BlockHasher(16)
    a, b = hasher.hash(first.prompt), hasher.hash(second.prompt)
    assert len(a) == 2 and b[:2] == a and len(b) == 4  # the turn shares exactly its whole shared blocks
    third = hasher.hash(mooncake_tokens([1089, 7], 32, block_tokens=16))
    assert third[0] == a[0] and third[1] != a[1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (_bailian(hash_ids=[1, 2]), r"2 hash_ids for input_length 40; a bailian: trace has one per 16 tokens"),
        (_bailian(timestamp=-0.5), "timestamp must be a non-negative number of s"),
        (_bailian(timestamp=1e11), r"at most 1e\+10 s"),
        (_bailian(hash_ids=[1, 2, 2**28]), r"hash_ids must be a list of ints in \[0, 268435455\]"),
        (_bailian(output_length=-1), "output_length"),  # 0 counts as 1, as in the CSV formats
        ('{"chat_id": 1, "timestamp": 0.5}', "missing field"),
    ],
)
def test_malformed_bailian_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(_bailian() + "\n" + line + "\n")
    with pytest.raises(InvalidTraceError, match=rf"bad\.jsonl:2: .*{message}"):
        read_bailian(path)


def test_a_bailian_conversation_is_routed_to_its_cached_turns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each turn repeats the chat so far: the default follows it, round-robin scatters it."""
    from prefixroute.cli import main

    lines = []
    for chat in range(5):  # five chats on four backends: round-robin moves each chat on at every turn
        ids: list[int] = []
        for turn in range(6):
            ids += [10_000 * chat + 100 * turn + k for k in range(8)]  # 128 more tokens a turn
            lines.append(_bailian(chat_id=6 * chat + turn, timestamp=2.0 * turn + 0.1 * chat,
                                  input_length=16 * len(ids), hash_ids=ids, output_length=8))  # fmt: skip
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.json"
    argv = ["compare", "--trace", f"bailian:{path}", "--backends", "4", "--policy", "round-robin", "--jobs", "1"]
    assert main([*argv, "--policy", "predicted-ttft", "--json", str(out)]) == 0, capsys.readouterr().err
    hits = {r["policy"]: r["hit_rate"] for r in json.loads(out.read_text())["results"]}
    assert hits["predicted-ttft"] > 0.5 > hits["round-robin"]


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


def test_azure_offsets_of_every_form_name_the_same_instant(tmp_path: Path) -> None:
    """Azure's files write +00:00; a trace written by other tools in this layout may say Z, a negative offset, or
    one of half an hour, with or without its colon: each row below is the same instant, the last one second on."""
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2024-05-10 12:00:00+00:00,1,1\n2024-05-10 12:00:00Z,2,1\n2024-05-10 07:00:00-05:00,3,1\n"
                    "2024-05-10 17:30:00+05:30,4,1\n2024-05-10T17:30:00+0530,5,1\n2024-05-10 02:15:00-0945,6,1\n"
                    "2024-05-10 12:00:01+00:00,7,1\n")  # fmt: skip
    assert [(e.arrival, e.input_length) for e in read_azure(path)] == [(0.0, n) for n in range(1, 7)] + [(1.0, 7)]


@pytest.fixture
def new_york_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's local time zone set to one with daylight saving time, and put back after."""
    if not hasattr(time, "tzset"):
        pytest.skip("time.tzset() is Unix-only")
    monkeypatch.setenv("TZ", "EST5EDT,M3.2.0,M11.1.0")  # New York's rules, as POSIX spells them: no tzdata needed
    time.tzset()
    try:
        yield
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.usefixtures("new_york_clock")
def test_azure_dates_without_an_offset_are_utc_whatever_the_local_time_zone(tmp_path: Path) -> None:
    """New York's clocks went from 01:59:59 to 03:00 on 2023-03-12: read as local time these rows are one hour
    apart, not two."""
    assert time.localtime(1678602600).tm_isdst == 0 and time.localtime(1678606200).tm_isdst == 1  # the zone is on
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-03-12 01:30:00,1,1\n2023-03-12 03:30:00,2,1\n")
    assert [e.arrival for e in read_azure(path)] == [0.0, 7200.0]


def test_load_trace_reads_a_home_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `--trace azure:~/t.csv`: the shell leaves a ~ after "azure:" as it is.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374,44\n")
    assert len(load_trace("azure:~/t.csv")) == 1


def test_azure_rows_need_not_be_sorted(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,10,2\n2023-11-16 18:15:40,20,2\n")
    assert [(e.arrival, e.input_length) for e in read_azure(path)] == [(0.0, 20), (6.5, 10)]


def test_a_json_integer_of_too_many_digits_and_a_line_without_end_are_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1' + "0" * 5000 + ', "input_length": 600, "output_length": 10, "hash_ids": [1]}\n')
    with pytest.raises(InvalidTraceError, match=r"t\.jsonl:1: not a trace record"):
        read_mooncake(path)
    path.write_text("x" * (2 << 20))
    with pytest.raises(InvalidTraceError, match=r"t\.jsonl:1: a line over 1,048,576 characters"):
        read_mooncake(path)


def test_a_pipe_is_read_from_its_start(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    line = '{"timestamp": 5, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}\n'
    writer = threading.Thread(target=fifo.write_text, args=(line * 300,))  # more than the 512 bytes sniffed
    writer.start()
    try:
        assert len(read_mooncake(fifo)) == 300
    finally:
        writer.join(timeout=10)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("yesterday,10,2", "expected a date and time"),
        ("2023-02-30 00:00:00,10,2", "expected a date and time"),
        ("2023-11-16 18:15:50+05:99,10,2", "expected a date and time"),
        ("2023-11-16 18:15:60,10,2", "expected a date and time"),  # as datetime refuses a leap second
        # other scripts' digits, as in counts and seconds: \d matched them, so these read as 2023 and 0.5 s
        ("\u0662023-11-16 18:15:50,10,2", "expected a date and time"),
        ("\uff12\uff10\uff12\uff13-11-16 18:15:50,10,2", "expected a date and time"),
        ("2023-11-16 18:15:50.\u0665,10,2", "expected a date and time"),
        ("2023-11-16 18:15:50+\u0660\u0665:00,10,2", "expected a date and time"),
        ("2423-11-16 18:15:40,10,2", "within 1e\\+10 s of the first row's"),
        ("2023-11-16 18:15:50,-1,2", r"token counts in \[0,"),
        ("2023-11-16 18:15:50,10,-1", r"token counts in \[0,"),
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
                    "5,ChatGPT,472,18,490,Conversation log\n45,GPT-4,1087,0,1087,API log\n"
                    "46,GPT-4,0,0,0,API log\n")  # fmt: skip
    entries = read_burstgpt(path)
    assert [(e.arrival, e.input_length, e.output_length) for e in entries] == [
        (0.0, 472, 18), (40.0, 1087, 1), (41.0, 1, 1)  # from the first request; a failed one's 0 tokens count as one
    ]  # fmt: skip
    path.write_text("Timestamp,Model,Request tokens\n5,ChatGPT,472\n")
    with pytest.raises(InvalidTraceError, match="header lacks column.s. Response tokens"):
        read_burstgpt(path)


def test_trace_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidTraceError, match="FORMAT:PATH"):
        load_trace("sharegpt:x.csv")
    with pytest.raises(InvalidTraceError, match="cannot read trace"):
        load_trace(f"mooncake:{tmp_path / 'missing.jsonl'}")
    with pytest.raises(
        InvalidTraceError, match="--trace azure: names no file: give FORMAT:PATH, such as azure:trace.csv$"
    ):
        load_trace("azure:")
    with pytest.raises(InvalidTraceError, match="--trace bailian: names no file: .* such as bailian:trace.jsonl$"):
        load_trace("bailian:")


def test_a_path_may_hold_a_colon(tmp_path: Path) -> None:
    """FORMAT ends at the first colon: the rest, colons and all, is the path."""
    path = tmp_path / "run:2024-05-10.jsonl"
    path.write_text(_line() + "\n")
    assert len(load_trace(f"mooncake:{path}")) == 1


@pytest.mark.parametrize(
    ("reader", "content"),
    [
        (read_mooncake, "\n  \n"),
        (read_bailian, ""),
        (read_splitwise, "arrived_at,num_prefill_tokens,num_decode_tokens\n"),
        (read_burstgpt, "Timestamp,Request tokens,Response tokens\n\n \n"),
    ],
)
def test_a_trace_with_no_request_names_its_file(tmp_path: Path, reader: Callable[[Path], Any], content: str) -> None:
    path = tmp_path / "t.trace"
    path.write_text(content)
    with pytest.raises(InvalidTraceError, match=r"t\.trace: no requests in the trace$"):
        reader(path)


def test_splitwise_sims_three_columns_alone_are_read(tmp_path: Path) -> None:
    """Its trace cut down to the columns replayed (request_id and the others dropped) is still SplitwiseSim's."""
    path = tmp_path / "s.csv"
    path.write_text("arrival_timestamp,prompt_size,token_size\n1,4096,32\n3,2048,8\n")
    assert [(e.arrival, e.input_length, e.output_length) for e in read_splitwise(path)] == [(0, 4096, 32), (2, 2048, 8)]


def test_shared_traces_parse(data_dir: Path) -> None:
    assert len(read_mooncake(data_dir / "mooncake-fast25" / "synthetic_trace.jsonl")) == 3993
    code = read_splitwise(data_dir / "vidur-profiling" / "processed_traces" / "splitwise_code.csv")
    assert len(code) == 8819 and all(e.input_length >= 1 for e in code)


def test_files_as_published_crlf_bom_and_no_final_newline(tmp_path: Path) -> None:
    # Azure's 2023 CSVs end lines with CRLF and have no final newline; a file saved by Excel starts with a BOM.
    azure = tmp_path / "azure.csv"
    azure.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                      b"2023-11-16 18:17:03.9799600,4808,10\r\n2023-11-16 18:17:04.0319600,3180,8")  # fmt: skip
    assert [e.input_length for e in read_azure(azure)] == [4808, 3180]
    burst = tmp_path / "burst.csv"
    burst.write_bytes(b"\xef\xbb\xbfTimestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\r\n"
                      b"5,ChatGPT,472,18,490,Conversation log\r\n")  # fmt: skip
    assert [e.input_length for e in read_burstgpt(burst)] == [472]
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_bytes(b"\xef\xbb\xbf" + _line().encode() + b"\r\n" + _line(timestamp=3).encode())
    assert len(read_mooncake(mooncake)) == 2


@pytest.mark.parametrize(
    ("reader", "lines", "entry"),
    [
        (read_azure, ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:17:03.9799600,4808,10"], (4808, 10)),
        (read_burstgpt, ["Timestamp,Request tokens,Response tokens", "5,4808,10"], (4808, 10)),
        (read_mooncake, [_line(), _line(timestamp=3)], (600, 5)),
    ],
)
def test_a_trace_whose_byte_order_mark_was_saved_twice_reads(
    tmp_path: Path, reader: Callable[[Path], Any], lines: list[str], entry: tuple[int, int]
) -> None:
    """A tool that reads a file with a BOM as plain UTF-8 keeps the mark as a character, and may write its own
    before it. A CSV said "header lacks column(s) Timestamp; it looks like a burstgpt: trace (--trace
    burstgpt:...)", the format it was given, and a JSONL file "not valid JSON (Unexpected UTF-8 BOM ...)"."""
    path = tmp_path / "t"
    path.write_bytes(b"\xef\xbb\xbf" * 2 + "\r\n".join(lines).encode() + b"\r\n")
    assert [(e.input_length, e.output_length) for e in reader(path)][0] == entry


def test_blank_lines_and_lines_of_spaces_are_skipped_and_an_empty_file_is_named(tmp_path: Path) -> None:
    azure = tmp_path / "a.csv"  # a line of spaces was a row of one field, refused
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:17:03.9799600,4808,10\r\n   \r\n\r\n"
                     "2023-11-16 18:17:04.9799600,10,1\r\n \t \r\n")  # fmt: skip
    assert [e.input_length for e in read_azure(azure)] == [4808, 10]
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n  \n2023-11-16 18:17:03,x,10\n")
    with pytest.raises(InvalidTraceError, match=r"a\.csv:3: expected a date and time"):  # the file's line numbers
        read_azure(azure)
    azure.write_text("")  # it said "header lacks column(s) TIMESTAMP, ContextTokens, GeneratedTokens"
    with pytest.raises(InvalidTraceError, match=r"a\.csv: no requests in the trace \(the file is empty\)"):
        read_azure(azure)
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(_line() + "\n   \n\t\n" + _line(timestamp=3) + "\n")
    assert len(read_mooncake(mooncake)) == 2


def test_unsorted_rows_are_replayed_in_time_order(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n2.0,30,1\n0.0,10,1\n2.0,31,1\n1.0,20,1\n")
    assert [(e.arrival, e.input_length) for e in read_splitwise(path)] == [(0, 10), (1, 20), (2, 30), (2, 31)]
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(_line(timestamp=900) + "\n" + _line(timestamp=100, input_length=512, hash_ids=[7]) + "\n")
    assert [(e.arrival, e.input_length) for e in read_mooncake(mooncake)] == [(0.0, 512), (0.8, 600)]  # from 100 ms
    azure = tmp_path / "a.csv"  # later rows out of order, none before the first: seconds after the first row
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1,1\n"
                     "2023-11-16 18:00:09,9,1\n2023-11-16 18:00:03,3,1\n")  # fmt: skip
    assert [(e.arrival, e.input_length) for e in read_azure(azure)] == [(0, 1), (3, 3), (9, 9)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", r"gzip-compressed, not text: decompress it first \(gunzip\)"),
        ("arrived_at\n0\n".encode("utf-16"), r"not UTF-8 text \(UTF-16\): save it as UTF-8"),
    ],
)
def test_compressed_or_other_encodings_say_what_to_do(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(content)
    for reader in (read_splitwise, read_mooncake):
        with pytest.raises(InvalidTraceError, match=rf"t\.csv: {message}"):
            reader(path)


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path: Path) -> None:
    # The decoder reads 8 KiB at a time: its own error gave the byte's offset in that chunk (5755 here, for a byte
    # 190 KB in) and no line.
    burst = tmp_path / "b.csv"
    row = b"5,ChatGPT,472,18,490,Conversation log\n"
    burst.write_bytes(b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + row * 5000
                      + b"6,Chat\xe9,47,18,65,API log\n" + row * 10)  # fmt: skip
    with pytest.raises(InvalidTraceError, match=r"b\.csv:5002: not UTF-8 text \(byte 0xe9 at byte 7 of the line\)"):
        read_burstgpt(burst)
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_bytes(b"\xef\xbb\xbf" + (_line() + "\n").encode() * 3 + b'{"caf\xc3\xa9": "\xff\xfd"}\n')
    with pytest.raises(InvalidTraceError, match=r"m\.jsonl:4: not UTF-8 text \(byte 0xff at byte 12 of the line\)"):
        read_mooncake(mooncake)
    mooncake.write_bytes((_line() + "\n").encode() + b"\xe2\x82")  # a character cut off at the end of the file
    with pytest.raises(InvalidTraceError, match=r"m\.jsonl:2: not UTF-8 text \(byte 0xe2 at byte 1"):
        read_mooncake(mooncake)
    mooncake.write_text(_line(note="caf\u00e9 \U0001f600") + "\n", encoding="utf-8")  # UTF-8 beyond ASCII reads
    assert len(read_mooncake(mooncake)) == 1


@pytest.mark.parametrize(
    ("kind", "content", "hint"),
    [
        ("azure", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,GPT-4,4,4,8,API log\n",
         "burstgpt:"),
        ("splitwise", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,1,1\n", "azure:"),
        ("burstgpt", _line() + "\n", "mooncake:"),
        ("mooncake", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n", "splitwise:"),
        ("mooncake", _bailian() + "\n", "bailian:"),
        ("bailian", _line() + "\n", "mooncake:"),
        ("splitwise", _bailian() + "\n", "bailian:"),
    ],
)  # fmt: skip
def test_a_trace_of_another_format_names_the_format(tmp_path: Path, kind: str, content: str, hint: str) -> None:
    path = tmp_path / "t.txt"
    path.write_text(content)
    article = "an" if hint == "azure:" else "a"
    rerun = re.escape(f"(--trace {hint}{path})")
    with pytest.raises(InvalidTraceError, match=rf"t\.txt:1: .*looks like {article} {hint} trace {rerun}$"):
        load_trace(f"{kind}:{path}")


@pytest.mark.parametrize(
    ("kind", "content", "message"),
    [
        ("mooncake", _line() + "\n" + _bailian() + "\n",
         r"m\.jsonl:2: 3 hash_ids for input_length 40; a mooncake: trace has one per 512 tokens, ceil\(40/512\) = 1$"),
        ("bailian", _bailian() + "\n" + _line() + "\n",
         r"m\.jsonl:2: 2 hash_ids for input_length 600; a bailian: trace has one per 16 tokens, ceil\(600/16\) = 38$"),
        ("splitwise", "time,prompt\n0,1\n",
         r"m\.jsonl:1: header lacks column\(s\) arrived_at, num_prefill_tokens, num_decode_tokens$"),
    ],
)  # fmt: skip
def test_no_other_format_is_named_for_a_file_this_one_has_read_or_none_reads(
    tmp_path: Path, kind: str, content: str, message: str
) -> None:
    """The hint is for a file given the wrong FORMAT, found at its first line: a bad line after lines this format
    read is that line's error alone (it may parse as the other format by chance), and a header that no format has
    is named as it is."""
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidTraceError, match=message):
        load_trace(f"{kind}:{path}")


def test_load_trace_keeps_only_the_first_requests_but_checks_every_line(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n1,10,1\n0,20,1\n2,30,1\n")
    assert [e.input_length for e in load_trace(f"splitwise:{path}", limit=2).entries] == [20, 10]
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n1,10,1\n0,20,1\n2,x,1\n")
    with pytest.raises(InvalidTraceError, match=r"s\.csv:4:"):
        load_trace(f"splitwise:{path}", limit=1)


def test_a_limit_keeps_the_earliest_rows_of_a_trace_written_latest_first(tmp_path: Path) -> None:
    """Each row after the first ``limit`` is earlier than every one kept so far, so each replaces the latest kept;
    of equal timestamps the first in the file are kept."""
    path = tmp_path / "s.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{t},{10 + t},1\n" for t in range(5, -1, -1)) + "0,99,1\n")  # fmt: skip
    assert [(e.arrival, e.input_length) for e in read_splitwise(path, limit=3)] == [(0, 10), (0, 99), (1, 11)]
    assert [(e.arrival, e.input_length) for e in read_splitwise(path, limit=1)] == [(0, 10)]


@pytest.mark.parametrize("command", [["simulate"], ["compare", "--jobs", "1"]])
def test_the_cli_reads_a_trace_once(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixroute.cli import main
    from prefixroute.sim import traces

    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    + "".join(f"{t},ChatGPT,{40 + t},3,{43 + t},API log\n" for t in range(50)))  # fmt: skip
    opened: list[str] = []
    real_open = traces._open

    def counting_open(p: str | Path) -> TextIO:
        opened.append(str(p))
        return real_open(p)

    monkeypatch.setattr(traces, "_open", counting_open)
    policies = ["--policy", "round-robin", "--policy", "prefix-affinity"]
    assert main([*command, *policies, "--trace", f"burstgpt:{path}", "--requests", "4", "--backends", "2"]) == 0
    assert opened == [str(path)], capsys.readouterr().err


def test_timestamps_past_float_millisecond_resolution_are_refused(tmp_path: Path) -> None:
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(_line(timestamp=1.7e12) + "\n" + _line(timestamp=1e300) + "\n")  # epoch ms is fine
    with pytest.raises(InvalidTraceError, match=r"m\.jsonl:2: timestamp must be .*at most 1e\+13 ms"):
        read_mooncake(mooncake)
    burst = tmp_path / "b.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1e11,GPT-4,4,4,8,API log\n")
    with pytest.raises(InvalidTraceError, match=r"b\.csv:2: Timestamp must be a finite number in \[0, 1e\+10\]"):
        read_burstgpt(burst)
    zero = tmp_path / "z.bin"
    zero.write_bytes(b"\0" * 64)  # /dev/zero, a disk image: refused at once, not read line by line forever
    with pytest.raises(InvalidTraceError, match=r"z\.bin: binary data, not text"):
        read_mooncake(zero)


_AT_MOST_SECONDS = 10**10  # the latest replayed arrival the readers and check_speedup allow: 1e10 s, not past it
_AT_MOST_TOKENS = 2**20  # the longest prompt or output a trace line may give


@pytest.mark.parametrize(
    ("reader", "content"),
    [
        (read_mooncake, _line() + "\n" + _line(timestamp=_AT_MOST_SECONDS * 1000) + "\n"),  # in ms
        (read_bailian, _bailian(timestamp=0) + "\n" + _bailian(timestamp=_AT_MOST_SECONDS) + "\n"),
        (read_splitwise, f"arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n{_AT_MOST_SECONDS:.0e},1,1\n"),
        (read_burstgpt, f"Timestamp,Request tokens,Response tokens\n0,1,1\n{_AT_MOST_SECONDS},1,1\n"),
    ],
)
def test_a_timestamp_of_exactly_1e10_s_is_read(tmp_path: Path, reader: Callable[[Path], Any], content: str) -> None:
    """Only a timestamp past 1e10 s is refused (docs/simulator.md): 1e10 itself is the last one read."""
    path = tmp_path / "t"
    path.write_text(content)
    assert [e.arrival for e in reader(path)] == [0.0, _AT_MOST_SECONDS]


def _azure_rows(*seconds: float) -> str:
    """An Azure trace whose rows are ``seconds`` after (or before) 2000-01-01 00:00 UTC, in that order."""
    start = datetime(2000, 1, 1, tzinfo=timezone.utc)
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{(start + timedelta(seconds=s)).isoformat(' ')},{i + 1},1\n" for i, s in enumerate(seconds)
    )


@pytest.mark.parametrize(
    ("offset", "expected"),
    [(_AT_MOST_SECONDS, [(0.0, 1), (_AT_MOST_SECONDS, 2)]), (-_AT_MOST_SECONDS, [(0.0, 2), (_AT_MOST_SECONDS, 1)])],
)  # the second row 1e10 s after the first, or before it
def test_an_azure_row_exactly_1e10_s_from_the_first_is_read(
    tmp_path: Path, offset: int, expected: list[tuple[float, int]]
) -> None:
    path = tmp_path / "a.csv"
    path.write_text(_azure_rows(0, offset))
    assert [(e.arrival, e.input_length) for e in read_azure(path)] == expected


def test_azure_rows_each_within_1e10_s_of_the_first_but_spanning_more_are_refused(tmp_path: Path) -> None:
    """Rows before the first row are kept (arrivals count from the earliest), so each row's own check does not
    bound the replay: 0.6e10 s before the first and 0.6e10 s after it span 1.2e10 s."""
    path = tmp_path / "a.csv"
    path.write_text(_azure_rows(0, -0.6 * _AT_MOST_SECONDS, 0.6 * _AT_MOST_SECONDS))
    with pytest.raises(InvalidTraceError, match=r"a\.csv: its TIMESTAMPs span more than 1e\+10 s"):
        read_azure(path)
    path.write_text(_azure_rows(0, -0.5 * _AT_MOST_SECONDS, 0.5 * _AT_MOST_SECONDS))  # exactly 1e10 s: read
    assert [e.arrival for e in read_azure(path)] == [0.0, 0.5 * _AT_MOST_SECONDS, _AT_MOST_SECONDS]


@pytest.mark.parametrize(
    ("reader", "row"),
    [(read_splitwise, "arrived_at,num_prefill_tokens,num_decode_tokens\n-0.5,10,2\n"),
     (read_burstgpt, "Timestamp,Request tokens,Response tokens\n-5,10,2\n")],
)  # fmt: skip
def test_a_negative_csv_arrival_in_seconds_is_refused(tmp_path: Path, reader: Callable[[Path], Any], row: str) -> None:
    """Only Azure's dates may lie before the first row's; seconds are a clock from 0, as JSONL timestamps are."""
    path = tmp_path / "t.csv"
    path.write_text(row)
    with pytest.raises(InvalidTraceError, match=r"t\.csv:2: \w+ must be a finite number in \[0, 1e\+10\]") as error:
        reader(path)
    header, values = row.splitlines()
    assert f"{header.split(',')[0]!r}: {values.split(',')[0]!r}" in str(error.value)  # the row, as read


def test_the_longest_lengths_and_the_highest_hash_id_are_read(tmp_path: Path) -> None:
    """The bounds the errors name are inclusive: 2**20 tokens, and the hash id whose block ends at token id
    2**32 - 1 (the last uint32)."""
    top = 2**32 // 512 - 1
    path = tmp_path / "m.jsonl"
    blocks = _AT_MOST_TOKENS // 512
    path.write_text(_line(input_length=_AT_MOST_TOKENS, output_length=_AT_MOST_TOKENS,
                          hash_ids=[*range(blocks - 1), top]) + "\n")  # fmt: skip
    workload = load_trace(f"mooncake:{path}")
    request = workload.next_request(0)
    assert request is not None and (request.prompt_tokens, request.output_tokens) == (_AT_MOST_TOKENS,) * 2
    assert int.from_bytes(request.prompt[-4:], "little") == 2**32 - 1
    csv_path = tmp_path / "s.csv"
    csv_path.write_text(f"arrived_at,num_prefill_tokens,num_decode_tokens\n0,{_AT_MOST_TOKENS},{_AT_MOST_TOKENS}\n")
    assert [(e.input_length, e.output_length) for e in read_splitwise(csv_path)] == [(_AT_MOST_TOKENS,) * 2]


def test_a_line_of_exactly_2_to_the_20_characters_is_read(tmp_path: Path) -> None:
    """Only a line over 2**20 characters is refused (docs/simulator.md)."""
    line = _line()
    path = tmp_path / "m.jsonl"
    path.write_text(line + " " * (2**20 - len(line) - 1) + "\n")
    assert len(read_mooncake(path)) == 1


def test_a_speedup_that_stretches_the_trace_too_far_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixroute.cli import main

    path = tmp_path / "m.jsonl"
    path.write_text(_line() + "\n" + _line(timestamp=3000) + "\n")
    assert main(["simulate", "--trace", f"mooncake:{path}", "--speedup", "1e-310"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--speedup 1e-310 puts the trace's last request at" in err and "give a --speedup of at least 3e-10" in err


def test_check_speedup_allows_a_last_arrival_of_exactly_1e10_s(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(_line() + "\n" + _line(timestamp=_AT_MOST_SECONDS * 1000) + "\n")
    workload = load_trace(f"mooncake:{path}")
    check_speedup(workload, 1.0)
    with pytest.raises(
        ConfigurationError, match=r"at 2e\+10 simulated s, past 1e\+10: give a --speedup of at least 1$"
    ):
        check_speedup(workload, 0.5)
    check_speedup(TraceWorkload([], kind="mooncake"), 1e-300)  # no arrival to place


@pytest.mark.parametrize("speedup", [0, 0.0, -1.0, float("nan"), float("inf"), 10**400, True, "2"])
def test_check_speedup_refuses_a_speedup_that_is_not_a_finite_positive_number(tmp_path: Path, speedup: object) -> None:
    """Before, 0 raised ZeroDivisionError and NaN passed as "a --speedup of at least 0"; inf divided every arrival
    to 0 (a trace of one instant)."""
    path = tmp_path / "m.jsonl"
    path.write_text(_line() + "\n" + _line(timestamp=3000) + "\n")
    given = "an int of 1329 bits" if speedup == 10**400 else repr(speedup)  # not its 401 digits
    with pytest.raises(ConfigurationError, match=rf"--speedup must be a finite number > 0, not {re.escape(given)}$"):
        check_speedup(load_trace(f"mooncake:{path}"), speedup)  # type: ignore[arg-type]


@pytest.mark.parametrize("workload", [None, [], "mooncake:t.jsonl"])
def test_check_speedup_of_something_not_a_workload_is_a_type_error(workload: object) -> None:
    with pytest.raises(
        TypeError, match=rf"a TraceWorkload \(load_trace\(\) gives one\), not {type(workload).__name__}$"
    ):
        check_speedup(workload, 2.0)  # type: ignore[arg-type]


_BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


@pytest.mark.parametrize(
    ("reader", "header", "first", "row"),
    [
        (read_splitwise, "arrived_at,num_prefill_tokens,num_decode_tokens", "0.0,5,5", "0.5,1,000,7"),  # 1,000
        (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46,5,5", "2023-11-16 18:15:50,10,2,"),
        (read_burstgpt, _BURSTGPT_HEADER, "5,GPT-4,5,5,10,x", "45,GPT-4,1,087,230,1317,Conversation log"),
        (read_burstgpt, _BURSTGPT_HEADER, "5,GPT-4,5,5,10,x", "45,1087,230,1317,Conversation log"),  # no Model
    ],
)
def test_a_row_with_more_or_fewer_fields_than_the_header_names_its_line(
    tmp_path: Path, reader: Callable[[Path], object], header: str, first: str, row: str
) -> None:
    """A stray or unquoted comma, or a dropped column, shifts the fields: the counts would be read from others."""
    path = tmp_path / "t.csv"
    path.write_text(f"{header}\n{first}\n{row}\n")
    fields, columns = len(row.split(",")), len(header.split(","))
    with pytest.raises(
        InvalidTraceError, match=rf"t\.csv:3: {fields} field\(s\) where the header names {columns}"
    ) as error:
        reader(path)
    assert f"{header.split(',')[0]!r}: {row.split(',')[0]!r}" in str(error.value)  # the row, as read


def test_a_row_the_csv_module_refuses_names_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"  # a field over csv's 131,072-character limit (or a NUL byte, on Python 3.10)
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,1,7\n0.6,1,7\n0.7,2," + "7" * 140_000 + "\n")
    with pytest.raises(InvalidTraceError, match=r"t\.csv:4: not valid CSV \(field larger than field limit"):
        read_splitwise(path)  # it named line 3, the last good row's
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens," + "x" * 140_000 + "\n0.5,1,7,x\n")
    with pytest.raises(InvalidTraceError, match=r"t\.csv:1: not a CSV header \(field larger than field limit"):
        read_splitwise(path)


@pytest.mark.parametrize("row", ["0.5,1,7," + "x" * 10**5, "0.5," + "1" * 10**5 + "x,7", "0.5,-1,7" + " " * 10**5])
def test_a_bad_row_is_shown_short_in_the_error(tmp_path: Path, row: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(f"arrived_at,num_prefill_tokens,num_decode_tokens\n{row}\n")
    with pytest.raises(InvalidTraceError, match=r"t\.csv:2: ") as error:
        read_splitwise(path)
    assert len(str(error.value)) < 600


def test_a_header_that_names_a_column_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,num_prefill_tokens\n0.0,100,7,9\n")
    with pytest.raises(InvalidTraceError, match=r"t\.csv:1: header names column\(s\) num_prefill_tokens more than"):
        read_splitwise(path)
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Model\n5,a,10,2,b\n")  # an ignored one: no matter
    assert [(e.input_length, e.output_length) for e in read_burstgpt(path)] == [(10, 2)]


@pytest.mark.parametrize("reader", [read_mooncake, read_bailian, read_splitwise, read_azure, read_burstgpt])
@pytest.mark.parametrize("path", [0, 1, True, None, 2.5])
def test_a_path_that_is_not_a_path_is_a_type_error(reader: Callable[[object], object], path: object) -> None:
    """open() takes an int as a file descriptor: 0 read the caller's stdin, and both were closed after."""
    before = os.fstat(1)
    with pytest.raises(TypeError, match=rf"a trace's path must be a str or a pathlib.Path, not {type(path).__name__}$"):
        reader(path)
    assert os.fstat(1).st_ino == before.st_ino  # stdout still open


@pytest.mark.parametrize("spec", [None, 3, Path("mooncake:t.jsonl"), b"mooncake:t.jsonl"])
def test_load_trace_of_a_spec_that_is_not_a_str_is_a_type_error(spec: object) -> None:
    with pytest.raises(TypeError, match="a trace must be given as a str 'FORMAT:PATH'"):
        load_trace(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reader", "content"),
    [
        (read_mooncake, _line() + "\n"),
        (read_bailian, _bailian() + "\n"),
        (read_splitwise, "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,2\n"),
        (read_azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,2\n"),
        (read_burstgpt, "Timestamp,Request tokens,Response tokens\n5,10,2\n"),
    ],
)
@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3"])
def test_every_reader_checks_its_limit(
    tmp_path: Path, reader: Callable[..., object], content: str, limit: object
) -> None:
    """As load_trace does; before, 0 and -1 raised IndexError and "3" a TypeError from the heap's comparison."""
    path = tmp_path / "t"
    path.write_text(content)
    with pytest.raises(
        ConfigurationError, match=rf"limit must be a positive int or None, not {re.escape(repr(limit))}$"
    ):
        reader(path, limit=limit)


@pytest.mark.parametrize(
    ("option", "value"),
    [*[("output_tokens", value) for value in (0, -3, 2.5, True, "7")],
     *[("seed", value) for value in ("1", None, True, 1.5, [1])]],
)  # fmt: skip
def test_a_workload_option_is_checked_when_the_workload_is_made(tmp_path: Path, option: str, value: object) -> None:
    """An output_tokens override: before, load_trace accepted it and the first next_request() raised a bare
    ValueError (or built a request with 2.5 or True output tokens). A seed, as TraceWorkload documents: it is what
    makes a CSV trace's unique prompts reproducible."""
    error: type[Exception] = TypeError
    message = rf"seed must be an int, not {type(value).__name__}$"
    if option == "output_tokens":
        error, message = (
            ConfigurationError,
            rf"output_tokens must be a positive int or None, not {re.escape(repr(value))}$",
        )
    path = tmp_path / "m.jsonl"
    path.write_text(_line() + "\n")
    with pytest.raises(error, match=message):
        load_trace(f"mooncake:{path}", **{option: value})  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        TraceWorkload(read_mooncake(path), kind="mooncake", **{option: value})  # type: ignore[arg-type]


def _requests(workload: TraceWorkload) -> list[SimRequest]:
    requests = []
    while (request := workload.next_request(0)) is not None:
        requests.append(request)
    return requests


def test_an_output_tokens_override_replaces_every_lines_output_length(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(_line(output_length=5) + "\n" + _line(timestamp=3, output_length=9) + "\n")
    assert [r.output_tokens for r in _requests(load_trace(f"mooncake:{path}"))] == [5, 9]
    for tokens in (1, 7):
        for workload in (
            load_trace(f"mooncake:{path}", output_tokens=tokens),
            TraceWorkload(read_mooncake(path), kind="mooncake", output_tokens=tokens),
        ):
            assert [r.output_tokens for r in _requests(workload)] == [tokens, tokens]


def test_a_seed_makes_the_unique_prompts_of_a_csv_trace_reproducible(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,100,1\n1,100,1\n2,50,1\n")

    def prompts(seed: int) -> list[bytes]:
        return [r.prompt for r in _requests(load_trace(f"splitwise:{path}", seed=seed))]

    assert prompts(3) == prompts(3) != prompts(4)
    assert [r.prompt for r in _requests(TraceWorkload(read_splitwise(path), kind="splitwise", seed=3))] == prompts(3)


@pytest.mark.parametrize("draw", ["lowest", "highest"])
def test_a_unique_prompts_token_ids_stay_in_the_upper_half_of_uint32_wherever_the_draw_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, draw: str
) -> None:
    """From 2**31 on, clear of the ids of any Mooncake hash id below 2**22, and below 2**32, where uint32 ids end
    (past it building the prompt raises)."""
    monkeypatch.setattr(random.Random, "randrange", lambda _self, n: 0 if draw == "lowest" else n - 1)
    path = tmp_path / "s.csv"
    path.write_text(f"arrived_at,num_prefill_tokens,num_decode_tokens\n0,{_AT_MOST_TOKENS},1\n")
    [request] = _requests(load_trace(f"splitwise:{path}"))
    first, last = (int.from_bytes(request.prompt[i : i + 4], "little") for i in (0, len(request.prompt) - 4))
    assert request.prompt_tokens == _AT_MOST_TOKENS and first >= 2**31 and last == first + _AT_MOST_TOKENS - 1


def test_a_mooncake_field_given_twice_is_refused(tmp_path: Path) -> None:
    """json.loads keeps the last of two equal keys: input_length 600 then 700 read as 700 (both need 2 hash_ids)."""
    path = tmp_path / "m.jsonl"
    path.write_text(_line() + "\n" + _line()[:-1] + ', "input_length": 700}\n')
    with pytest.raises(InvalidTraceError, match=r"m\.jsonl:2: field input_length given more than once"):
        read_mooncake(path)


@pytest.mark.parametrize(
    "row", ["0.5,1_000,7", "0.5,\uff11\uff10,7", "0.5,10.5,7", "0.5,1e3,7", "1_0,10,7", "\uff10.5,10,7"]
)
def test_csv_counts_and_arrivals_are_ascii_numbers(tmp_path: Path, row: str) -> None:
    """int() reads 1_000 and full-width digits, float() 1_0 and full-width digits: a broken row read as numbers.
    The error shows the row as read."""
    path = tmp_path / "t.csv"
    path.write_text(f"arrived_at,num_prefill_tokens,num_decode_tokens\n{row}\n")
    arrival, prompt, _ = row.split(",")
    with pytest.raises(InvalidTraceError, match=r"t\.csv:2: expected numbers and token counts") as error:
        read_splitwise(path)
    assert f"'arrived_at': {arrival!r}, 'num_prefill_tokens': {prompt!r}" in str(error.value)


def test_a_csv_count_with_a_zero_fraction_is_read(tmp_path: Path) -> None:
    """As a table that once held an empty cell writes its counts (pandas: 1000.0)."""
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5, 1000.0 ,7.\n1,+12,3\n")
    assert [(e.input_length, e.output_length) for e in read_splitwise(path)] == [(1000, 7), (12, 3)]


@pytest.mark.parametrize("reader", [read_mooncake, read_bailian])
def test_jsonl_zero_lengths_count_as_one_as_in_the_csv_formats(tmp_path: Path, reader: Any) -> None:
    # Was: input_length or output_length 0 refused in JSONL, while a CSV's 0 counted as 1.
    path = tmp_path / "zero.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}\n')
    [entry] = reader(path)
    assert (entry.input_length, entry.output_length, entry.hash_ids) == (1, 1, ())
    csv_path = tmp_path / "zero.csv"
    csv_path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,0,0\n")
    [same] = read_splitwise(csv_path)
    assert (same.input_length, same.output_length) == (entry.input_length, entry.output_length)
    workload = TraceWorkload([entry], kind="zero")
    request = workload.next_request(0)
    assert request is not None and request.prompt_tokens == 1 and request.output_tokens == 1


@pytest.mark.parametrize("blank", ["\n", "  \n", "\r\n\t\r\n", "\n \n\n"])
def test_blank_lines_before_a_csv_header_are_skipped(tmp_path: Path, blank: str) -> None:
    # Was: "header lacks column(s) arrived_at, num_prefill_tokens, num_decode_tokens".
    path = tmp_path / "s.csv"
    path.write_text(blank + "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,7\n0.5,x,3\n")
    lines = blank.count("\n")
    with pytest.raises(InvalidTraceError, match=rf"s\.csv:{lines + 3}: expected numbers"):  # the file's own line
        read_splitwise(path)
    path.write_text(blank + "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,7\n")
    assert [(e.input_length, e.output_length) for e in read_splitwise(path)] == [(100, 7)]
    path.write_text(blank + "time,prompt\n0,1\n")
    with pytest.raises(InvalidTraceError, match=rf"s\.csv:{lines + 1}: header lacks"):
        read_splitwise(path)
    path.write_text(blank)
    with pytest.raises(InvalidTraceError, match=r"no requests in the trace \(the file is blank: no header\)"):
        read_splitwise(path)
