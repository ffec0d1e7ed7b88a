"""Trace readers against the public traces exactly as published: a few real lines of each file in its own layout,
read through the readers, ``load_trace`` and the CLI, with the variants and awkward details the files hold.

Sources (the lines below are copied from them, or typed after them; the data files themselves are not in the
repository):

- Mooncake FAST'25 ``FAST25-release/traces/conversation_trace.jsonl`` (kvcache-ai/Mooncake, 12,031 lines, the
  first lines), and the arXiv ``FAST25-release/arxiv-trace/mooncake_trace.jsonl`` (its first lines, as NVIDIA
  Dynamo's replay tests quote them).
- Qwen-Bailian ``qwen_thinking_blksz_16.jsonl`` (alibaba-edu/qwen-bailian-usagetraces-anon; its lines as quoted by
  the simulators that replay it): float seconds from 0.0, ``type`` also ``thinking`` and ``image``.
- Azure LLM inference 2023 ``data/AzureLLMInferenceTrace_code.csv`` (Azure/AzurePublicDataset, first rows: seven
  fractional digits, no zone) and the 2024 ``AzureLLMInferenceTrace_{code,conv}_1week.csv`` release files (six
  fractional digits and ``+00:00``; a whole second is written without a fraction, so one file mixes
  ``…00:00:00+00:00`` and ``…00:00:00.001163+00:00``).
- BurstGPT v1.1 ``BurstGPT_1.csv`` (six columns, integer seconds from 5; failed rows: ``Response tokens`` 0) and
  ``BurstGPT_without_fails_1.csv``, ``API log`` rows, and v1.2 ``BurstGPT_3.csv`` (eight columns with ``Session ID``
  and ``Elapsed time``, float seconds that continue the earlier files' clock: its first row is at 19,440,110 s, 225
  days in; ``BurstGPT_2.csv`` likewise continues ``BurstGPT_1.csv`` two months in), whose API-log rows leave
  ``Session ID`` empty.
- Vidur ``data/processed_traces/splitwise_conv.csv`` (microsoft/vidur; also in data/vidur-profiling here), and
  SplitwiseSim's own request trace (Mutinifni/splitwise-sim ``traces/test_trace.csv``, as its ``generate_trace.py``
  writes them): ``request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size``.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from prefixroute import BlockHasher
from prefixroute.cli import main
from prefixroute.errors import InvalidTraceError
from prefixroute.sim.traces import load_trace, read_azure, read_burstgpt, read_mooncake, read_splitwise

MOONCAKE_CONVERSATION = """\
{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 2290, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}
{"timestamp": 3000, "input_length": 915, "output_length": 355, "hash_ids": [0, 462]}
{"timestamp": 5999, "input_length": 1053, "output_length": 26, "hash_ids": [0, 773, 774]}
{"timestamp": 9000, "input_length": 8772, "output_length": 1, "hash_ids": [0, 859, 860, 861, 862, 863, 864, 865, 866, 867, 868, 869, 870, 871, 872, 873, 874, 875]}
"""  # noqa: E501

MOONCAKE_ARXIV = """\
{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
{"timestamp": 0, "input_length": 9013, "output_length": 3, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63]}
{"timestamp": 0, "input_length": 6506, "output_length": 3, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 64]}
{"timestamp": 0, "input_length": 3119, "output_length": 20, "hash_ids": [74, 75, 76, 77, 78, 79, 80]}
{"timestamp": 3052, "input_length": 6166, "output_length": 24, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 433]}
"""  # noqa: E501

AZURE_2023_CODE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.0781490,110,27
2023-11-16 18:17:33.4590290,1555,19
"""

AZURE_2024 = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,2048,10
2024-05-10 00:00:01+00:00,1930,8
2024-05-10 00:00:01.500000+00:00,7685,0
"""

# BurstGPT_1.csv's first rows; BurstGPT_without_fails_1.csv's are the same, but for the failed rows it leaves out.
_BURSTGPT_1_HEAD = """\
Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,230,1317,Conversation log
"""

BURSTGPT_1 = _BURSTGPT_1_HEAD + "118,GPT-4,417,276,693,Conversation log\n120,GPT-4,0,0,0,Conversation log\n"

BURSTGPT_3 = """\
Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
19440110.0,1722ac82-0a46-4bf0-aa08-89794e7a2b3f,43,GPT-4,906,446,1352,Conversation log
19440161.0,d5983bf9-4b48-497b-892b-a58995247443,2,ChatGPT,36,29,65,Conversation log
19440192.0,a5c69b35-4fbc-45e9-955e-18715e376d74,8,GPT-4,1779,123,1902,Conversation log
19440254.0,8b74c7d8-1643-4bba-8c69-91cb4548c506,3,ChatGPT,935,178,1113,Conversation log
"""

VIDUR_SPLITWISE_CONV = """\
arrived_at,num_prefill_tokens,num_decode_tokens
0.0,374,44
4.314579,396,109
4.541877,879,55
5.8926549999999995,91,16
"""

BAILIAN_THINKING = "".join(
    json.dumps(line) + "\n"
    for line in [
        {"chat_id": 0, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40, "output_length": 1494,
         "type": "thinking", "turn": 1, "hash_ids": [0, 1, 2]},
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.387, "input_length": 20, "output_length": 0,
         "type": "image", "turn": 1, "hash_ids": [3, 4]},
        {"chat_id": 2, "parent_chat_id": 0, "timestamp": 61.114, "input_length": 70, "output_length": 132,
         "type": "thinking", "turn": 2, "hash_ids": [0, 1, 5, 6, 7]},
    ]
)  # fmt: skip


BURSTGPT_WITHOUT_FAILS_1 = (
    _BURSTGPT_1_HEAD + "118,GPT-4,417,276,693,Conversation log\n127,ChatGPT,1360,42,1402,API log\n"
)

BURSTGPT_1_WITH_FAILS = _BURSTGPT_1_HEAD + "46,GPT-4,2843,0,2843,API log\n118,GPT-4,417,276,693,Conversation log\n"

BURSTGPT_3_WITH_API_ROWS = """\
Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
19440110.0,1722ac82-0a46-4bf0-aa08-89794e7a2b3f,43.0,GPT-4,906,446,1352,Conversation log
19440111.5,,1.25,ChatGPT,3120,57,3177,API log
19440161.0,d5983bf9-4b48-497b-892b-a58995247443,2.0,ChatGPT,36,29,65,Conversation log
19440170.0,,0.0,GPT-4,1200,0,1200,API log
"""


AZURE_2024_MIXED = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-12 00:00:00+00:00,1452,3
2024-05-12 00:00:00.041683+00:00,584,3
2024-05-12 00:00:01+00:00,862,38
2024-05-12 00:00:01.158932+00:00,1569,3
"""


SPLITWISE_SIM = """\
request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size
0,2,0,1,1,4096,32
1,2,0,3,1,2048,8
2,2,0,4,1,2048,16
"""


def _write(tmp_path: Path, name: str, text: str, newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))
    return path


def _all(spec: str) -> list[tuple[float, int, int]]:
    workload = load_trace(spec)
    return [(round(e.arrival, 6), e.input_length, e.output_length) for e in workload.entries]


def _shared_blocks(a: bytes, b: bytes) -> int:
    """Leading 16-token blocks two prompts share, as the router's hasher sees them."""
    hasher = BlockHasher(16)
    shared = 0
    for x, y in zip(hasher.hash(a), hasher.hash(b), strict=False):
        if x != y:
            break
        shared += 1
    return shared


def test_mooncake_conversation_trace_as_published(tmp_path: Path) -> None:
    path = _write(tmp_path, "conversation_trace.jsonl", MOONCAKE_CONVERSATION)
    entries = read_mooncake(path)
    assert [e.arrival for e in entries] == [0.0, 0.0, 3.0, 5.999, 9.0]  # ms
    assert [(e.input_length, e.output_length) for e in entries][-1] == (8772, 1)
    workload = load_trace(f"mooncake:{path}")
    prompts = [r.prompt for r in iter(lambda: workload.next_request(0), None) if r is not None]
    assert len(prompts) == 5 and len(prompts[0]) == 4 * 6758
    assert _shared_blocks(prompts[0], prompts[1]) == 512 // 16  # hash id 0: the first 512 tokens, no more
    assert _shared_blocks(prompts[2], prompts[3]) == 512 // 16


def test_mooncake_arxiv_trace_as_published(tmp_path: Path) -> None:
    path = _write(tmp_path, "mooncake_trace.jsonl", MOONCAKE_ARXIV)
    workload = load_trace(f"mooncake:{path}")
    requests = [workload.next_request(0) for _ in range(5)]
    assert [r.arrival for r in requests if r is not None] == [0.0, 0.0, 0.0, 0.0, 3.052]
    second, third, fifth = requests[1], requests[2], requests[4]
    assert second is not None and third is not None and fifth is not None
    assert _shared_blocks(second.prompt, third.prompt) == 12 * 512 // 16  # ids 46..57 in common
    assert _shared_blocks(third.prompt, fifth.prompt) == 12 * 512 // 16


def test_mooncake_slice_counts_from_its_first_request(tmp_path: Path) -> None:
    """A slice cut from the middle of the arXiv trace (as republished, from 1,178,625 ms) starts at once."""
    lines = MOONCAKE_ARXIV.replace('"timestamp": 3052', '"timestamp": 1181678').replace(
        '"timestamp": 0,', '"timestamp": 1178625,'
    )
    entries = read_mooncake(_write(tmp_path, "slice.jsonl", lines))
    assert [e.arrival for e in entries] == pytest.approx([0.0, 0.0, 0.0, 0.0, 3.053])


def test_azure_2023_trace_as_published(tmp_path: Path) -> None:
    entries = read_azure(_write(tmp_path, "AzureLLMInferenceTrace_code.csv", AZURE_2023_CODE))
    assert [e.arrival for e in entries] == pytest.approx([0.0, 0.052, 0.098189, 29.479069], abs=1e-6)
    assert [(e.input_length, e.output_length) for e in entries] == [(4808, 10), (3180, 8), (110, 27), (1555, 19)]


def test_azure_2023_seven_digit_fractions_across_midnight(tmp_path: Path) -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9799600,4808,10\n2023-11-17 00:00:00.0319600,3180,8\n"
    )
    assert _all(f"azure:{_write(tmp_path, 'AzureLLMInferenceTrace_code.csv', text)}") == [
        (0.0, 4808, 10),
        (0.052, 3180, 8),
    ]


def test_azure_2024_week_trace_as_published(tmp_path: Path) -> None:
    entries = read_azure(_write(tmp_path, "AzureLLMInferenceTrace_code_1week.csv", AZURE_2024))
    assert [e.arrival for e in entries] == pytest.approx([0.0, 0.99007, 1.49007], abs=1e-6)
    assert [(e.input_length, e.output_length) for e in entries] == [(2048, 10), (1930, 8), (7685, 1)]


def test_azure_2024_week_mixing_whole_and_fractional_seconds(tmp_path: Path) -> None:
    path = _write(tmp_path, "AzureLLMInferenceTrace_conv_1week.csv", AZURE_2024_MIXED, newline="\r\n")
    assert _all(f"azure:{path}") == [(0.0, 1452, 3), (0.041683, 584, 3), (1.0, 862, 38), (1.158932, 1569, 3)]


def test_burstgpt_v1_trace_as_published(tmp_path: Path) -> None:
    entries = read_burstgpt(_write(tmp_path, "BurstGPT_1.csv", BURSTGPT_1))
    assert [(e.input_length, e.output_length) for e in entries] == [(472, 18), (1087, 230), (417, 276), (1, 1)]
    assert [e.arrival for e in entries] == [0.0, 40.0, 113.0, 115.0]  # seconds after the first request


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("BurstGPT_without_fails_1.csv", BURSTGPT_WITHOUT_FAILS_1,
         [(0.0, 472, 18), (40.0, 1087, 230), (113.0, 417, 276), (122.0, 1360, 42)]),
        ("BurstGPT_1.csv", BURSTGPT_1_WITH_FAILS,
         [(0.0, 472, 18), (40.0, 1087, 230), (41.0, 2843, 1), (113.0, 417, 276)]),
        ("BurstGPT_3.csv", BURSTGPT_3_WITH_API_ROWS,
         [(0.0, 906, 446), (1.5, 3120, 57), (51.0, 36, 29), (60.0, 1200, 1)]),
    ],
)  # fmt: skip
def test_burstgpt_variants_with_failed_and_api_rows(
    tmp_path: Path, name: str, text: str, expected: list[tuple[float, int, int]]
) -> None:
    assert _all(f"burstgpt:{_write(tmp_path, name, text)}") == expected


def test_burstgpt_v2_trace_counts_from_its_first_request(tmp_path: Path) -> None:
    """BurstGPT_3.csv's clock starts 225 days in: replayed as is, the fleet idled for 225 simulated days."""
    entries = read_burstgpt(_write(tmp_path, "BurstGPT_3.csv", BURSTGPT_3))
    assert [e.arrival for e in entries] == [0.0, 51.0, 82.0, 144.0]
    assert [(e.input_length, e.output_length) for e in entries] == [(906, 446), (36, 29), (1779, 123), (935, 178)]


def test_burstgpt_v2_trace_replays_within_a_duration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--duration 600`` of BurstGPT_3.csv served no request at all (a row of nan), and ``--metrics-interval``
    polled 1.9e8 times before the first arrival."""
    path = _write(tmp_path, "BurstGPT_3.csv", BURSTGPT_3)
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", f"burstgpt:{path}", "--policy", "round-robin", "--duration", "600"]
    assert main([*argv, "--metrics-interval", "0.5", "--json", str(out)]) == 0, capsys.readouterr().err
    (result,) = json.loads(out.read_text())["results"]
    assert result["requests"] == 4


def test_vidur_splitwise_trace_as_published(tmp_path: Path) -> None:
    entries = read_splitwise(_write(tmp_path, "splitwise_conv.csv", VIDUR_SPLITWISE_CONV))
    assert [e.arrival for e in entries] == [0.0, 4.314579, 4.541877, 5.8926549999999995]
    assert [(e.input_length, e.output_length) for e in entries][0] == (374, 44)


def test_splitwise_sim_request_trace(tmp_path: Path) -> None:
    """``splitwise:`` refused SplitwiseSim's own trace: its header lacks Vidur's ``arrived_at`` columns."""
    path = _write(tmp_path, "test_trace.csv", SPLITWISE_SIM)
    assert _all(f"splitwise:{path}") == [(0.0, 4096, 32), (2.0, 2048, 8), (3.0, 2048, 16)]
    with pytest.raises(InvalidTraceError, match=r"lacks column\(s\) TIMESTAMP.*looks like a splitwise: trace"):
        load_trace(f"azure:{path}")


@pytest.mark.parametrize(
    ("spec", "name", "text"),
    [
        ("bailian", "qwen_thinking_blksz_16.jsonl", BAILIAN_THINKING),
        ("burstgpt", "BurstGPT_1.csv", BURSTGPT_1_WITH_FAILS),
        ("burstgpt", "BurstGPT_3.csv", BURSTGPT_3_WITH_API_ROWS),
        ("azure", "AzureLLMInferenceTrace_conv_1week.csv", AZURE_2024_MIXED),
        ("splitwise", "test_trace.csv", SPLITWISE_SIM),
    ],
)
def test_cli_simulates_each_published_form(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, name: str, text: str
) -> None:
    path = _write(tmp_path, name, text)
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", f"{spec}:{path}", "--requests", "50", "--backends", "2"]
    assert main([*argv, "--policy", "round-robin", "--json", str(out)]) == 0, capsys.readouterr().err
    (result,) = json.loads(out.read_text())["results"]
    assert result["requests"] == len(text.strip().splitlines()) - (spec not in ("bailian", "mooncake"))


@pytest.mark.parametrize(
    ("spec", "name", "text", "line"),
    [
        # a download cut off mid-row
        ("burstgpt", "BurstGPT_1.csv", BURSTGPT_1_WITH_FAILS + "1201,ChatGPT,47", 6),
        ("azure", "AzureLLMInferenceTrace_code.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:0", 3),
        ("bailian", "qwen_traceA_blksz_16.jsonl", BAILIAN_THINKING + '{"chat_id": 3, "parent_chat_id": -1, "tim', 4),
        # a date in another layout
        ("azure", "AzureLLMInferenceTrace_code.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:17:03.9799600,4808,10\n16/11/2023 18:17,1,1\n", 3),
    ],
)  # fmt: skip
def test_a_malformed_line_is_exit_2_and_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, name: str, text: str, line: int
) -> None:
    path = _write(tmp_path, name, text)
    argv = ["simulate", "--trace", f"{spec}:{path}", "--requests", "50", "--backends", "2"]
    assert main([*argv, "--policy", "round-robin"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{name}:{line}:" in err, err


@pytest.mark.parametrize("kind", ["azure", "burstgpt"])
def test_a_large_file_is_read_whole_and_keeps_the_earliest_rows(tmp_path: Path, kind: str) -> None:
    """100,000 rows of a published layout: every row is checked, the ``limit`` earliest kept (a published week is
    tens of millions of rows; their read time is in the audit's report, not asserted here)."""
    rows = 100_000
    path = tmp_path / f"{kind}.csv"
    with path.open("w", encoding="utf-8", newline="") as file:
        if kind == "azure":
            file.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
            file.writelines(
                f"2024-05-10 {i // 36000 % 24:02d}:{i // 600 % 60:02d}:{i // 10 % 60:02d}.{i % 10}09930+00:00,"
                f"{100 + i % 7000},{1 + i % 300}\n"
                for i in range(rows)
            )
        else:
            file.write("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n")
            file.writelines(
                f"{5 + i // 4},{'GPT-4' if i % 5 else 'ChatGPT'},{100 + i % 7000},{i % 300},"
                f"{100 + i % 7000 + i % 300},{'API log' if i % 3 else 'Conversation log'}\n"
                for i in range(rows)
            )
    workload = load_trace(f"{kind}:{path}", limit=200)
    assert len(workload) == 200 and workload.entries[0].arrival == 0.0
    assert [e.input_length for e in workload.entries] == [100 + i for i in range(200)]


def test_a_few_requests_of_a_large_trace_hold_only_those(tmp_path: Path) -> None:
    """``--requests 10`` of an Azure week (27M rows) held every row while reading it: ~180 bytes a row, ~5 GB."""
    rows = 5_000
    path = tmp_path / "AzureLLMInferenceTrace_conv_1week.csv"
    with path.open("w", encoding="utf-8") as file:
        file.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i in range(rows):
            file.write(
                f"2024-05-12 {i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}.{i % 997:06d}+00:00,{1000 + i},9\n"
            )
    tracemalloc.start()
    try:
        workload = load_trace(f"azure:{path}", limit=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(workload) == 10 and [e.input_length for e in workload.entries] == list(range(1000, 1010))
    assert peak < 300_000, f"{peak:,} bytes for 10 of {rows:,} rows"
