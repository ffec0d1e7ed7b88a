"""Trace readers: JSONL traces with prefix identity (Mooncake FAST'25, Qwen-Bailian) and CSVs of lengths.

A Mooncake line gives ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token
block of the prompt, equal ids at equal positions marking a shared prefix. The reader turns hash id ``h`` into the
512 token ids ``512*h .. 512*h+511`` (the last block cut to the prompt's length), so the real hasher and index see
real token lists that share exactly what the trace says they share. A Qwen-Bailian line (Alibaba's
``qwen-bailian-usagetraces-anon``, ATC'25) is read the same way with its own units: ``timestamp`` in seconds and
one hash id per 16-token block (its other fields, ``chat_id``, ``parent_chat_id``, ``turn`` and ``type``, are
ignored: the timestamps already place each turn). A Splitwise/Vidur CSV
(``arrived_at,num_prefill_tokens,num_decode_tokens``, or SplitwiseSim's ``arrival_timestamp``, ``prompt_size``,
``token_size``), an Azure LLM inference trace
(``TIMESTAMP,ContextTokens,GeneratedTokens``) and a BurstGPT CSV (``Timestamp``, ``Request tokens``, ``Response
tokens``) have no prefix identity: every prompt gets its own tokens.

Readers parse and check the whole file up front (a malformed line raises :class:`InvalidTraceError` naming it)
but build a prompt's tokens only when the simulator asks for it. They return the requests in timestamp order (rows
with equal timestamps in file order), so a trace whose rows are not sorted still replays at its own timestamps, and
count arrivals from the earliest request: a file whose clock does not start at 0 (BurstGPT v1.2's ``BurstGPT_3.csv``
starts 225 days in, a slice of a Mooncake trace where it was cut) replays from its first request, not after months
of an idle fleet. A UTF-8 byte-order mark and CRLF line ends are read as published; a compressed file is refused
with what to do.
"""

from __future__ import annotations

import csv
import functools
import heapq
import io
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import MappingProxyType
from typing import TextIO

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTraceError, InvalidTypeError
from prefixroute.sim.request import SimRequest, token_bytes

__all__ = [
    "BAILIAN_BLOCK_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "TraceEntry",
    "TraceWorkload",
    "check_speedup",
    "load_trace",
    "mooncake_tokens",
    "read_azure",
    "read_bailian",
    "read_burstgpt",
    "read_mooncake",
    "read_splitwise",
]

MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16
_UNIQUE_BASE = 2**31  # Splitwise prompts draw their tokens above every Mooncake-derived id
_MAX_TOKENS = 2**20  # longer than any profiled model's context: a larger length is a broken trace
# Replayed arrivals past 1e10 s (317 years; epoch seconds are 1.7e9) are a broken trace or --speedup: at 1e300 s a
# float second has no room left for the milliseconds a TTFT is made of.
_MAX_ARRIVAL = 1e10
_MAX_LINE_CHARS = 1 << 20  # a Mooncake line of a 1M-token prompt holds ~2,000 block ids: ~16K characters


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One trace line: arrival (seconds), lengths, and the block ids of ``block_tokens`` tokens each (empty for the
    CSV formats)."""

    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


def mooncake_tokens(hash_ids: Sequence[int], input_length: int, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> bytes:
    """Return the prompt's token ids (uint32 little-endian bytes) for a trace line's ``hash_ids``, one id per
    ``block_tokens`` tokens (512 for Mooncake, :data:`BAILIAN_BLOCK_TOKENS` for Qwen-Bailian). O(tokens).

    As the readers check for every line: at least one hash id, each an int whose block stays within the uint32
    token ids, and ``input_length`` within the last one's block (more than ``block_tokens × (len(hash_ids) - 1)``,
    at most ``block_tokens × len(hash_ids)``).

    Raises:
        InvalidTraceError: the arguments break one of those rules (the message says which).
    """
    size = as_int(block_tokens)
    if size is None or size < 1:
        raise InvalidTraceError(f"block_tokens must be an int >= 1, not {shown(block_tokens)}")
    most_id = (2**32 - size) // size
    if (
        isinstance(hash_ids, (str, bytes))
        or not isinstance(hash_ids, Sequence)
        or not hash_ids
        or not all(as_int(h) is not None and 0 <= h <= most_id for h in hash_ids)
    ):
        raise InvalidTraceError(
            f"hash_ids must be a non-empty sequence of ints in [0, {most_id}], not {shown(hash_ids)}"
        )
    length = as_int(input_length)
    low, high = size * (len(hash_ids) - 1) + 1, size * len(hash_ids)
    if length is None or not low <= length <= high:
        raise InvalidTraceError(
            f"input_length must be an int in [{low}, {high}] for {len(hash_ids)} hash ids of {size} tokens, "
            f"not {shown(input_length)}"
        )
    return _block_tokens([int(h) for h in hash_ids], length, size)  # plain ints: numpy's too, checked above


def _block_tokens(hash_ids: Sequence[int], input_length: int, size: int) -> bytes:
    """:func:`mooncake_tokens` of arguments known good (a reader's :class:`TraceEntry`)."""
    last = input_length - size * (len(hash_ids) - 1)
    parts = [token_bytes(h * size, size) for h in hash_ids[:-1]]
    parts.append(token_bytes(hash_ids[-1] * size, last))
    return b"".join(parts)


class TraceWorkload:
    """Replay a parsed trace in order: ``next_request`` returns the next line's request, then None.

    With :class:`~prefixroute.sim.engine.TraceTimes` arrivals each request arrives at its timestamp; with closed-loop
    users the order is kept and the timestamps ignored. ``output_tokens`` overrides every line's output length.

    Raises:
        ConfigurationError: ``output_tokens`` is not a positive int or None.
        TypeError: ``seed`` is not an int.
    """

    def __init__(
        self, entries: Sequence[TraceEntry], *, kind: str, seed: int = 0, output_tokens: int | None = None
    ) -> None:
        if output_tokens is not None:
            count = as_int(output_tokens)
            if count is None or count < 1:
                # Checked now, not when the simulator asks for the first request (a bare ValueError mid-run).
                raise ConfigurationError(f"output_tokens must be a positive int or None, not {shown(output_tokens)}")
            output_tokens = count
        seed_int = as_int(seed)
        if seed_int is None:
            raise InvalidTypeError(f"seed must be an int, not {type(seed).__name__}")
        self.entries = list(entries)
        self.kind = kind
        self._cursor = 0
        self._rng = random.Random(seed_int)
        self._output_tokens = output_tokens

    @property
    def last_arrival(self) -> float:
        """The latest request's arrival, in the trace's seconds (0 for no request). O(requests)."""
        return max((entry.arrival for entry in self.entries), default=0.0)

    def __len__(self) -> int:
        return len(self.entries)

    def next_request(self, user: int) -> SimRequest | None:
        """Return the next trace line's request, or None at the end of the trace."""
        if self._cursor >= len(self.entries):
            return None
        entry = self.entries[self._cursor]
        self._cursor += 1
        if entry.hash_ids:
            prompt = _block_tokens(entry.hash_ids, entry.input_length, entry.block_tokens)
        else:
            start = _UNIQUE_BASE + self._rng.randrange(2**31 - entry.input_length)
            prompt = token_bytes(start, entry.input_length)
        output = self._output_tokens if self._output_tokens is not None else entry.output_length
        return SimRequest(prompt, output, arrival=entry.arrival, tag=f"{self.kind}:{self._cursor - 1}")


@dataclass(frozen=True, slots=True)
class _BlocksFormat:
    """A JSONL trace with prefix identity: its name, the tokens per hash id and the unit of its ``timestamp``."""

    kind: str
    block_tokens: int
    units_per_second: float  # of its timestamps
    unit: str

    @property
    def max_hash_id(self) -> int:
        return (2**32) // self.block_tokens - 1  # every block's token ids fit in uint32


_MOONCAKE = _BlocksFormat("mooncake", MOONCAKE_BLOCK_TOKENS, 1000.0, "ms")
_BAILIAN = _BlocksFormat("bailian", BAILIAN_BLOCK_TOKENS, 1.0, "s")


def read_mooncake(path: str | Path, *, limit: int | None = None) -> list[TraceEntry]:
    """Parse a Mooncake FAST'25 JSONL trace; raises :class:`InvalidTraceError` naming the first bad line.

    An ``input_length`` or ``output_length`` of 0 counts as 1, as in the CSV formats (vLLM computes at least one
    token of each); such a prompt has no ``hash_ids``, so its token is unique.

    With ``limit`` every line is still checked but only the ``limit`` earliest requests are kept (in this and the
    other readers), so a few requests from a trace of millions take memory for those alone. A ``path`` that is not
    a str or :class:`~pathlib.Path` raises TypeError, a ``limit`` that is not a positive int
    :class:`~prefixroute.errors.ConfigurationError`.
    """
    return _read_blocks(path, _MOONCAKE, limit)


def read_bailian(path: str | Path, *, limit: int | None = None) -> list[TraceEntry]:
    """Parse a Qwen-Bailian JSONL trace (``timestamp`` s, ``input_length``, ``output_length``, ``hash_ids`` of
    16-token blocks; other fields ignored), as :func:`read_mooncake` reads Mooncake's."""
    return _read_blocks(path, _BAILIAN, limit)


def _read_blocks(path: str | Path, form: _BlocksFormat, limit: int | None) -> list[TraceEntry]:
    entries = _Earliest(limit)
    with _open(path) as lines:
        for number, line in enumerate(_read(lines, path), start=1):
            if not line.strip():
                continue
            try:
                entries.add(_blocks_line(line, f"{path}:{number}", form))
            except InvalidTraceError as exc:
                other = None if entries.count else _csv_format(line) or _blocks_format(line, form)
                if other is None:
                    raise
                raise InvalidTraceError(f"{exc}; {_looks_like(other, path)}") from exc
    return _from_earliest(entries.sorted(), path, "timestamp")


def _blocks_format(line: str, wrong: _BlocksFormat) -> str | None:
    """The other JSONL format that reads ``line`` (a line ``wrong`` refused), if one does."""
    form = _BAILIAN if wrong is _MOONCAKE else _MOONCAKE
    try:
        _blocks_line(line, "", form)
    except InvalidTraceError:
        return None
    return form.kind


def _jsonl_kind(line: str) -> str:
    """The JSONL format a line (not read as one) most likely is: Qwen-Bailian names its chats, Mooncake does not."""
    return _BAILIAN.kind if '"chat_id"' in line else _MOONCAKE.kind


def _blocks_line(line: str, where: str, form: _BlocksFormat) -> TraceEntry:
    try:
        item = json.loads(line, object_pairs_hook=_object)
    except _DuplicateKeyError as exc:
        raise InvalidTraceError(f"{where}: field {exc.args[0]} given more than once") from exc
    except json.JSONDecodeError as exc:
        raise InvalidTraceError(f"{where}: not valid JSON ({exc.msg})") from exc
    except RecursionError as exc:
        raise InvalidTraceError(f"{where}: JSON nested too deeply") from exc
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise InvalidTraceError(f"{where}: not a trace record (a number of thousands of digits)") from exc
    if not isinstance(item, dict):
        raise InvalidTraceError(f"{where}: expected a JSON object, got {type(item).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in item]
    if missing:
        raise InvalidTraceError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp, input_length, output_length = item["timestamp"], item["input_length"], item["output_length"]
    hash_ids = item["hash_ids"]
    most = _MAX_ARRIVAL * form.units_per_second
    arrival = as_float(timestamp)
    if arrival is None or not 0 <= arrival <= most:
        raise InvalidTraceError(
            f"{where}: timestamp must be a non-negative number of {form.unit}, not {shown(timestamp)} "
            f"(at most {most:g} {form.unit})"
        )
    if not _is_int(input_length) or not 0 <= input_length <= _MAX_TOKENS:
        raise InvalidTraceError(f"{where}: input_length must be an int in [0, {_MAX_TOKENS}], not {input_length!r}")
    if not _is_int(output_length) or not 0 <= output_length <= _MAX_TOKENS:
        raise InvalidTraceError(f"{where}: output_length must be an int in [0, {_MAX_TOKENS}], not {output_length!r}")
    most_id = form.max_hash_id
    if not isinstance(hash_ids, list) or not all(_is_int(h) and 0 <= h <= most_id for h in hash_ids):
        raise InvalidTraceError(f"{where}: hash_ids must be a list of ints in [0, {most_id}]")
    size = form.block_tokens
    expected = -(-input_length // size)
    if len(hash_ids) != expected:
        raise InvalidTraceError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; a {form.kind}: trace has one per "
            f"{size} tokens, ceil({input_length}/{size}) = {expected}"
        )
    # As in the CSV formats: a logged request with no prompt or no output still cost the engine one token of each.
    return TraceEntry(
        arrival / form.units_per_second, max(1, input_length), max(1, output_length), tuple(hash_ids), size
    )


class _DuplicateKeyError(Exception):
    """A JSON object names a key twice (json.loads would keep the last value and drop the others unseen)."""


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    item = dict(pairs)
    if len(item) < len(pairs):
        keys = [key for key, _ in pairs]
        raise _DuplicateKeyError(next(key for key in keys if keys.count(key) > 1))
    return item


@dataclass(frozen=True, slots=True)
class _LengthsFormat:
    """A CSV trace of arrivals and lengths: its three columns and how its arrival column reads."""

    arrival: str
    prompt: str
    output: str
    dated: bool  # arrival is a date and time (relative to the earliest row), else seconds


# Each format's layouts, the first named when a header has none of them: ``splitwise`` is Vidur's
# ``processed_traces`` CSV and SplitwiseSim's own request trace (``traces/*.csv``, arrivals in seconds too).
_LENGTHS_FORMATS: Mapping[str, tuple[_LengthsFormat, ...]] = MappingProxyType(
    {
        "splitwise": (
            _LengthsFormat("arrived_at", "num_prefill_tokens", "num_decode_tokens", dated=False),
            _LengthsFormat("arrival_timestamp", "prompt_size", "token_size", dated=False),
        ),
        "azure": (_LengthsFormat("TIMESTAMP", "ContextTokens", "GeneratedTokens", dated=True),),
        "burstgpt": (_LengthsFormat("Timestamp", "Request tokens", "Response tokens", dated=False),),
    }
)
# An offset's minutes are 00-59 (timezone() would take +05:99 as 6 h 39 min). ASCII digits only, as in counts and
# seconds: a str pattern's \d matches any script's digits, and int() and float() read them.
_DATETIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?[0-5]\d)?", re.ASCII)


def read_splitwise(path: str | Path, *, limit: int | None = None) -> list[TraceEntry]:
    """Parse a Splitwise/Vidur CSV: Vidur's (``arrived_at`` s, ``num_prefill_tokens``, ``num_decode_tokens``) or
    SplitwiseSim's request trace (``arrival_timestamp`` s, ``prompt_size``, ``token_size``; its other columns ignored).

    In this and the other formats (the JSONL ones too) a request that generated no token counts as one, and a prompt
    of no tokens as one token (vLLM always computes one).
    """
    return _read_lengths(path, _LENGTHS_FORMATS["splitwise"], limit)


def read_azure(path: str | Path, *, limit: int | None = None) -> list[TraceEntry]:
    """Parse an Azure LLM inference trace CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``).

    The format of ``Azure/AzurePublicDataset``'s ``AzureLLMInferenceTrace_{code,conv}.csv`` (2023) and
    ``AzureLLMInferenceTrace_{code,conv}_1week.csv`` (2024), which Splitwise replays: ``TIMESTAMP`` is a date and
    time (``2023-11-16 18:15:46.6805900``, an optional UTC offset), arrivals are seconds after the earliest row's
    (rows need not be sorted).
    """
    return _read_lengths(path, _LENGTHS_FORMATS["azure"], limit)


def read_burstgpt(path: str | Path, *, limit: int | None = None) -> list[TraceEntry]:
    """Parse a BurstGPT CSV (``Timestamp`` s, ``Request tokens``, ``Response tokens``; other columns ignored)."""
    return _read_lengths(path, _LENGTHS_FORMATS["burstgpt"], limit)


def _read_lengths(path: str | Path, forms: Sequence[_LengthsFormat], limit: int | None) -> list[TraceEntry]:
    entries = _Earliest(limit)
    first: float | None = None  # of a dated trace: the first row's date, in seconds; arrivals are relative to it
    # A trace's rows share their minute with the rows around them: each minute is converted once per read (the
    # conversion was half of an Azure trace's reading time).
    minutes = functools.lru_cache(maxsize=1024)(_minute_seconds)
    with _open(path) as lines:
        # A line of spaces is read as the blank line it looks like (csv would make it a row of one field), and
        # csv.DictReader skips blank lines; each stays a line, so every error names the file's own line number.
        reader = csv.DictReader("\n" if line.isspace() else line for line in _read(lines, path))
        try:  # blank lines before the header are skipped too (DictReader would take the first as an empty header)
            header_row = next((row for row in reader.reader if row), None)
        except csv.Error as exc:
            raise InvalidTraceError(f"{path}:{reader.reader.line_num}: not a CSV header ({exc})") from exc
        if header_row is None:
            empty = "empty" if reader.reader.line_num == 0 else "blank: no header"
            raise InvalidTraceError(f"{path}: no requests in the trace (the file is {empty})")
        at = f"{path}:{reader.reader.line_num}"  # the header's line
        fieldnames = [name.strip() for name in header_row]
        reader.fieldnames = fieldnames
        form = next((f for f in forms if {f.arrival, f.prompt, f.output} <= set(fieldnames)), forms[0])
        columns = (form.arrival, form.prompt, form.output)
        absent = [c for c in columns if c not in fieldnames]
        if absent:
            header = ",".join(fieldnames)
            other = _csv_format(header) or (_jsonl_kind(header) if header.startswith("{") else None)
            hint = f"; {_looks_like(other, path)}" if other else ""
            raise InvalidTraceError(f"{at}: header lacks column(s) {', '.join(absent)}{hint}")
        twice = [c for c in columns if fieldnames.count(c) > 1]
        if twice:  # csv.DictReader would read the last of them and ignore the others
            raise InvalidTraceError(f"{at}: header names column(s) {', '.join(twice)} more than once")
        for row in _rows(reader, path):
            where = f"{path}:{reader.line_num}"
            if None in row or None in row.values():  # more fields than the header names, or fewer
                # A column dropped or an unquoted comma shifts the fields: the counts would be read from others.
                extra: list[str] = row.get(None) or []  # type: ignore[call-overload]
                fields = sum(row[name] is not None for name in fieldnames) + len(extra)
                raise InvalidTraceError(
                    f"{where}: {fields} field(s) where the header names {len(fieldnames)}: every row needs one "
                    f"value per column (quote a value that holds a comma): {shown(row)}"
                )
            try:
                arrival = _datetime_seconds(row[form.arrival], minutes) if form.dated else _seconds(row[form.arrival])
                prefill = _token_count(row[form.prompt])
                decode = _token_count(row[form.output])
            except (TypeError, ValueError) as exc:
                kind = "a date and time" if form.dated else "numbers"
                raise InvalidTraceError(
                    f"{where}: expected {kind} and token counts in {', '.join(columns)}: {shown(row)}"
                ) from exc
            if form.dated:
                first = arrival if first is None else first
                arrival -= first  # negative for a row before the first: all move up at the end
            if not (
                math.isfinite(arrival)
                and (-_MAX_ARRIVAL if form.dated else 0) <= arrival <= _MAX_ARRIVAL
                and 0 <= prefill <= _MAX_TOKENS
                and 0 <= decode <= _MAX_TOKENS
            ):
                start = (
                    f"within {_MAX_ARRIVAL:g} s of the first row's"
                    if form.dated
                    else f"a finite number in [0, {_MAX_ARRIVAL:g}]"
                )
                raise InvalidTraceError(
                    f"{where}: {form.arrival} must be {start} and token counts in [0, {_MAX_TOKENS}], got {shown(row)}"
                )
            # A logged request with no prompt or no output still cost the engine one token of each.
            entries.add(TraceEntry(arrival, max(1, prefill), max(1, decode)))
    return _from_earliest(entries.sorted(), path, form.arrival)


class _Earliest:
    """A reader's requests: all of them, or with ``limit`` only the ``limit`` earliest (equal arrivals: the first in
    the file), held in a heap whose top is the latest kept, so memory is O(limit) however long the file."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None:
            count = as_int(limit)
            if count is None or count < 1:  # 0 would leave a heap with no top to compare
                raise ConfigurationError(f"limit must be a positive int or None, not {shown(limit)}")
            limit = count
        self.limit = limit
        self.count = 0  # requests added
        self._all: list[TraceEntry] = []
        self._heap: list[tuple[float, int, TraceEntry]] = []  # (-arrival, -count, entry)

    def add(self, entry: TraceEntry) -> None:
        self.count += 1
        if self.limit is None:
            self._all.append(entry)
            return
        item = (-entry.arrival, -self.count, entry)  # the counts differ, so entries are never compared
        if len(self._heap) < self.limit:
            heapq.heappush(self._heap, item)
        elif item > self._heap[0]:  # earlier than the latest kept
            heapq.heapreplace(self._heap, item)

    def sorted(self) -> list[TraceEntry]:
        """The kept requests in arrival order, equal arrivals in file order."""
        if self.limit is None:
            self._all.sort(key=_arrival)  # stable: equal arrivals stay in file order
            return self._all
        return [entry for _, _, entry in sorted(self._heap, reverse=True)]


def _from_earliest(entries: list[TraceEntry], path: str | Path, column: str) -> list[TraceEntry]:
    """``entries`` (in arrival order) with their arrivals counted from the earliest."""
    if not entries:
        raise InvalidTraceError(f"{path}: no requests in the trace")
    earliest = entries[0].arrival
    if earliest == 0:
        return entries
    if entries[-1].arrival - earliest > _MAX_ARRIVAL:  # dated rows, each within 1e10 s of the first row's
        raise InvalidTraceError(f"{path}: its {column}s span more than {_MAX_ARRIVAL:g} s")
    for i, e in enumerate(entries):  # in place: a copy of a trace of millions would double its memory
        entries[i] = TraceEntry(e.arrival - earliest, e.input_length, e.output_length, e.hash_ids, e.block_tokens)
    return entries


def check_speedup(workload: TraceWorkload, speedup: float) -> None:
    """Check that replaying ``workload`` at its timestamps divided by ``speedup`` keeps every arrival within 1e10 s.

    Raises:
        ConfigurationError: ``speedup`` is not a finite number > 0, or so small that the last arrival lands past
            1e10 simulated seconds, where float seconds no longer resolve a millisecond.
        TypeError: ``workload`` is not a :class:`TraceWorkload`.
    """
    if not isinstance(workload, TraceWorkload):
        raise InvalidTypeError(
            f"workload must be a TraceWorkload (load_trace() gives one), not {type(workload).__name__}"
        )
    factor = as_float(speedup)
    if factor is None or factor <= 0:
        raise ConfigurationError(f"--speedup must be a finite number > 0, not {shown(speedup)}")
    speedup = factor
    last = workload.last_arrival
    if not last / speedup <= _MAX_ARRIVAL:
        raise ConfigurationError(
            f"--speedup {speedup:g} puts the trace's last request at {last / speedup:g} simulated s, past "
            f"{_MAX_ARRIVAL:g}: give a --speedup of at least {last / _MAX_ARRIVAL:.3g}"
        )


def _arrival(entry: TraceEntry) -> float:
    return entry.arrival


def _looks_like(kind: str, path: str | Path) -> str:
    """The hint that names the format a file of another format looks like."""
    article = "an" if kind[0] in "aeiou" else "a"
    return f"it looks like {article} {kind}: trace (--trace {kind}:{path})"


def _csv_format(header: str) -> str | None:
    """The CSV format whose columns ``header`` (a CSV header line) has, if any: to name it when the kind is wrong."""
    try:
        names = {name.strip() for name in next(csv.reader([header.lstrip("\ufeff")]), [])}
    except csv.Error:
        return None
    for kind, forms in _LENGTHS_FORMATS.items():
        if any({form.arrival, form.prompt, form.output} <= names for form in forms):
            return kind
    return None


def _datetime_seconds(
    value: str | None, minutes: Callable[[tuple[str, ...], str | None], float] | None = None
) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (any number of fractional digits; an optional
    UTC offset, else UTC), which ``datetime.fromisoformat`` reads only from Python 3.11. ``minutes`` converts the
    date, hour and minute (:func:`_minute_seconds`, or a cache of it)."""
    match = _DATETIME.fullmatch((value or "").strip())
    if match is None:
        raise ValueError(f"not a date and time: {value!r}")
    second, fraction = int(match.group(6)), match.group(7)
    if second > 59:
        raise ValueError(f"second must be in 0..59: {value!r}")
    minute = (minutes or _minute_seconds)(match.group(1, 2, 3, 4, 5), match.group(8))
    return minute + second + (float(f"0.{fraction}") if fraction else 0.0)


def _minute_seconds(parts: tuple[str, ...], offset: str | None) -> float:
    """Seconds since the epoch of a date, hour and minute (as text) at a UTC offset."""
    year, month, day, hour, minute = (int(part) for part in parts)
    zone = timezone.utc
    if offset and offset != "Z":
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        zone = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    return datetime(year, month, day, hour, minute, tzinfo=zone).timestamp()  # ValueError: no such date


def load_trace(
    spec: str, *, seed: int = 0, output_tokens: int | None = None, limit: int | None = None
) -> TraceWorkload:
    """Open ``FORMAT:PATH`` as a workload: ``mooncake:trace.jsonl`` or ``bailian:trace.jsonl``, or one of
    ``splitwise:``, ``azure:`` and ``burstgpt:`` with a CSV of arrivals and lengths (every prompt its own tokens).

    ``limit`` keeps only the first ``limit`` requests (in timestamp order) after every line has been checked, so a
    run of a few requests from a large trace holds only those, while reading too. A ``PATH`` starting with ``~`` is
    in the user's home folder, as the shell would read it.

    Raises:
        InvalidTraceError: ``spec`` is not ``FORMAT:PATH``, or the file cannot be read or has a malformed line.
        ConfigurationError: ``limit`` or ``output_tokens`` is not a positive int.
        TypeError: ``spec`` is not a str.
    """
    if not isinstance(spec, str):
        raise InvalidTypeError(
            f"a trace must be given as a str 'FORMAT:PATH', such as 'mooncake:trace.jsonl', not {spec!r}"
        )
    kind, sep, path = spec.partition(":")
    readers = {
        "mooncake": read_mooncake,
        "bailian": read_bailian,
        "splitwise": read_splitwise,
        "azure": read_azure,
        "burstgpt": read_burstgpt,
    }
    if not sep or kind not in readers:
        raise InvalidTraceError(f"--trace must be FORMAT:PATH with FORMAT one of {sorted(readers)}, not {spec!r}")
    if not path:  # open("") would say "cannot read trace : No such file or directory"
        example = f"{kind}:trace.{'jsonl' if readers[kind] in (read_mooncake, read_bailian) else 'csv'}"
        raise InvalidTraceError(f"--trace {spec} names no file: give FORMAT:PATH, such as {example}")
    # The shell expands a ``~`` that starts a word, not one after ``mooncake:``: expand it here.
    entries = readers[kind](os.path.expanduser(path), limit=limit)
    return TraceWorkload(entries, kind=kind, seed=seed, output_tokens=output_tokens)


# A trace's first bytes that say it is not UTF-8 text, and what to do about it.
_NOT_TEXT = (
    (b"\x1f\x8b", "gzip-compressed, not text: decompress it first (gunzip)"),
    (b"PK\x03\x04", "a zip archive, not text: extract the trace from it first (unzip)"),
    (b"BZh", "bzip2-compressed, not text: decompress it first (bunzip2)"),
    (b"\xfd7zXZ", "xz-compressed, not text: decompress it first (unxz)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed, not text: decompress it first (unzstd)"),
    (b"\xff\xfe", "not UTF-8 text (UTF-16): save it as UTF-8"),
    (b"\xfe\xff", "not UTF-8 text (UTF-16): save it as UTF-8"),
)


def _open(path: str | Path) -> TextIO:
    """Open a trace as text (UTF-8, a byte-order mark skipped; line ends as written, for :mod:`csv`), once: a pipe
    (``--trace mooncake:<(zcat trace.gz)``) is read from its start; a named pipe waits for its writer, as any
    reader of one does.

    Raises:
        TypeError: ``path`` is not a str or path (an int would be opened as a file descriptor, and closed).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidTypeError(f"a trace's path must be a str or a pathlib.Path, not {type(path).__name__}")
    try:
        raw = open(path, "rb")  # noqa: SIM115 - returned, wrapped, to a with block
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise InvalidTraceError(f"cannot read trace {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        head = raw.peek(512)[:512]  # sniffed without consuming it
        for magic, what in _NOT_TEXT:
            if head.startswith(magic):
                raise InvalidTraceError(f"{path}: {what}")
        if b"\0" in head:  # /dev/zero or a disk image: no line to read, ever
            raise InvalidTraceError(f"{path}: binary data, not text (a NUL byte in its first {len(head)} bytes)")
    except OSError as exc:
        raw.close()
        raise InvalidTraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    except InvalidTraceError:
        raw.close()
        raise
    # A byte that is not UTF-8 is decoded to a lone surrogate, found by _read in its line: the decoder works on
    # 8 KiB chunks, so its own error would name neither the line nor the byte's place in the file.
    return io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as errors="surrogateescape" decodes it


def _read(lines: TextIO, path: str | Path) -> Iterator[str]:
    """The file's lines; a file that is not UTF-8 text (the error names the line and the byte), fails while read,
    or has a line too long to be a trace's (a huge file without line ends) is an :class:`InvalidTraceError`.
    Reads one line at a time."""
    try:
        number = 0
        while line := lines.readline(_MAX_LINE_CHARS + 1):
            number += 1
            if len(line) > _MAX_LINE_CHARS:
                raise InvalidTraceError(f"{path}:{number}: a line over {_MAX_LINE_CHARS:,} characters is no trace's")
            if not line.isascii() and (bad := _NOT_UTF8.search(line)):  # isascii: the common line, checked fast
                column = len(line[: bad.start()].encode("utf-8", "surrogateescape")) + 1
                raise InvalidTraceError(
                    f"{path}:{number}: not UTF-8 text (byte 0x{ord(bad[0]) - 0xDC00:02x} at byte {column} of the "
                    "line): save it as UTF-8"
                )
            # utf-8-sig drops one byte-order mark; a tool that kept a file's mark as text and wrote its own left two
            yield line.lstrip("\ufeff") if number == 1 else line
    except OSError as exc:
        raise InvalidTraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc


def _rows(reader: csv.DictReader[str], path: str | Path) -> Iterator[dict[str, str]]:
    try:
        yield from reader
    except csv.Error as exc:
        # The DictReader's line_num is still the last good row's: the csv reader under it has counted the bad one.
        raise InvalidTraceError(f"{path}:{reader.reader.line_num}: not valid CSV ({exc})") from exc


_COUNT = re.compile(r"\s*([+-]?[0-9]+)(?:\.0*)?\s*")  # 1000, or 1000.0 as a table that held an empty cell writes it


def _token_count(text: str | None) -> int:
    """A CSV token count: ASCII digits, optionally with a zero fraction; ValueError otherwise (``int()`` would take
    ``1_000`` and other scripts' digits)."""
    match = _COUNT.fullmatch(text or "")
    if match is None:
        raise ValueError(f"not a token count: {text!r}")
    return int(match[1])


def _seconds(text: str | None) -> float:
    """A CSV arrival in seconds, as ``float()`` reads ASCII text without ``_`` (it would take ``1_0`` as 10)."""
    if text is None or not text.isascii() or "_" in text:
        raise ValueError(f"not a number of seconds: {text!r}")
    return float(text)


def _is_int(value: object) -> bool:
    """Whether a JSON value is an int (JSON's true and false are bools, not counts)."""
    return isinstance(value, int) and not isinstance(value, bool)
