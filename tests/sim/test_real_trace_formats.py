"""Published trace files in their exact published form, read through ``load_trace`` and the CLI.

Each sample is a handful of lines typed after the upstream file (formats and sources in the module docstring of
``test_traces_real_formats.py`` and below); these cover the variants and awkward details that file does not:

- Qwen-Bailian ``qwen_thinking_blksz_16.jsonl`` (alibaba-edu/qwen-bailian-usagetraces-anon; its lines as quoted by
  the simulators that replay it): float seconds from 0.0, ``type`` also ``thinking`` and ``image``.
- BurstGPT ``BurstGPT_without_fails_1.csv`` and ``BurstGPT_1.csv`` (failed rows: ``Response tokens`` 0), ``API log``
  rows, and v1.2 ``BurstGPT_3.csv`` whose API-log rows leave ``Session ID`` empty.
- Azure 2024 ``_1week`` files mixing ``…00:00:00+00:00`` and ``…00:00:00.001163+00:00`` in one file.
- SplitwiseSim's own request trace (Mutinifni/splitwise-sim ``traces/test_trace.csv``, as its ``generate_trace.py``
  writes them): ``request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixroute.cli import main
from prefixroute.errors import InvalidTraceError
from prefixroute.sim.traces import load_trace


def _write(tmp_path: Path, name: str, text: str, newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes(text.replace("\n", newline).encode("utf-8"))
    return path


def _all(spec: str) -> list[tuple[float, int, int]]:
    workload = load_trace(spec)
    return [(round(e.arrival, 6), e.input_length, e.output_length) for e in workload.entries]


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


BURSTGPT_WITHOUT_FAILS_1 = """\
Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,230,1317,Conversation log
118,GPT-4,417,276,693,Conversation log
127,ChatGPT,1360,42,1402,API log
"""

BURSTGPT_1_WITH_FAILS = """\
Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,230,1317,Conversation log
46,GPT-4,2843,0,2843,API log
118,GPT-4,417,276,693,Conversation log
"""

BURSTGPT_3_WITH_API_ROWS = """\
Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
19440110.0,1722ac82-0a46-4bf0-aa08-89794e7a2b3f,43.0,GPT-4,906,446,1352,Conversation log
19440111.5,,1.25,ChatGPT,3120,57,3177,API log
19440161.0,d5983bf9-4b48-497b-892b-a58995247443,2.0,ChatGPT,36,29,65,Conversation log
19440170.0,,0.0,GPT-4,1200,0,1200,API log
"""


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


AZURE_2024_MIXED = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-12 00:00:00+00:00,1452,3
2024-05-12 00:00:00.041683+00:00,584,3
2024-05-12 00:00:01+00:00,862,38
2024-05-12 00:00:01.158932+00:00,1569,3
"""


def test_azure_2024_week_mixing_whole_and_fractional_seconds(tmp_path: Path) -> None:
    path = _write(tmp_path, "AzureLLMInferenceTrace_conv_1week.csv", AZURE_2024_MIXED, newline="\r\n")
    assert _all(f"azure:{path}") == [(0.0, 1452, 3), (0.041683, 584, 3), (1.0, 862, 38), (1.158932, 1569, 3)]


def test_azure_2023_seven_digit_fractions_across_midnight(tmp_path: Path) -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 23:59:59.9799600,4808,10\n2023-11-17 00:00:00.0319600,3180,8\n"
    )
    assert _all(f"azure:{_write(tmp_path, 'AzureLLMInferenceTrace_code.csv', text)}") == [
        (0.0, 4808, 10),
        (0.052, 3180, 8),
    ]


SPLITWISE_SIM = """\
request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size
0,2,0,1,1,4096,32
1,2,0,3,1,2048,8
2,2,0,4,1,2048,16
"""


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
