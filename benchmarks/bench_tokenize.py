"""What PromptTokenizer's piece cache saves when texts share a long prefix, and what it costs when they share none.

Method. Texts are cut from this repository's docs (English prose, tables and code): 2K-token prompts made of one of 8
shared 1K-token prefixes (the docs' first 16K tokens) and 1K tokens from a random place in the rest (``shared``), or
2K tokens from a random place in the rest (``unique``), plain text without special tokens. Each pass encodes fresh
texts (a new seed) with

* ``encode``: the ``tokenizers`` library alone, ``Tokenizer.encode_batch_fast([text])``, what the proxy would pay
  without a cache (``encode`` proper, with character offsets, costs more);
* ``no cache``: ``PromptTokenizer(cache_tokens=0)``;
* ``cache``: ``PromptTokenizer()``, its cache warmed with the 8 prefixes (``shared``), or emptied before each text
  (``unique``: the parts of texts cut from one corpus would otherwise meet again, as cuts realign after a few parts).

and the figure is the process's CPU time (all threads) per text, median of ``--runs`` passes after a warm-up, and
its ratio to ``encode`` in the same run. Every result is checked against ``encode``'s ids.

Tokenizers: the real models' ``tokenizer.json`` files LiteLLM ships (DeepSeek's, Anthropic's) when it is installed,
and any ``--tokenizer PATH``.

Run: ``python benchmarks/bench_tokenize.py`` (about a minute), ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from _args import Parser, existing_file, positive_int
from tokenizers import Tokenizer

from prefixroute.adapters.tokenize import PromptTokenizer

ROOT = Path(__file__).resolve().parents[1]


def tokenizer_files(extra: list[Path]) -> dict[str, Path]:
    files: dict[str, Path] = {}
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.submodule_search_locations:
        shipped = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
        files.update({path.stem: path for path in sorted(shipped.glob("*.json"))})
    files.update({str(path): path for path in extra})
    if not files:
        raise SystemExit("no tokenizer: install prefixroute[litellm] (LiteLLM ships real ones) or pass --tokenizer")
    return files


class Texts:
    """Prompts cut from the repository's docs at token boundaries of one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, *, tokens: int) -> None:
        docs = sorted((ROOT / "docs").glob("*.md"))
        self.corpus = "\n\n".join(path.read_text(encoding="utf-8") for path in docs)
        self.starts = [start for start, _ in tokenizer.encode(self.corpus, add_special_tokens=False).offsets]
        self.half = tokens // 2
        if len(self.starts) < 8 * tokens + 4 * tokens:
            raise SystemExit(f"the docs hold {len(self.starts)} tokens: too few for {tokens}-token prompts")

    def cut(self, first: int, count: int) -> str:
        return self.corpus[self.starts[first] : self.starts[first + count]]

    def prefixes(self) -> list[str]:
        return [self.cut(i * 2 * self.half, self.half) for i in range(8)]

    def prompts(self, count: int, *, shared: bool, seed: int) -> list[str]:
        """Continuations come from past the prefixes, at random places (a fresh seed each pass)."""
        rng = random.Random(seed)
        low = 16 * self.half + 1
        high = len(self.starts) - 2 * self.half - 1
        prefixes = self.prefixes()
        if shared:
            return [prefixes[i % 8] + self.cut(rng.randrange(low, high), self.half) for i in range(count)]
        return [self.cut(rng.randrange(low, high), 2 * self.half) for _ in range(count)]


def cpu_per_text(encode: Callable[[str], list[int]], texts: list[str], expected: list[list[int]]) -> float:
    started = time.process_time()
    ids = [encode(text) for text in texts]
    elapsed = time.process_time() - started
    if ids != expected:
        raise SystemExit("the piece cache gave other ids than the tokenizer itself")
    return elapsed / len(texts)


def measure(name: str, tokenizer: Tokenizer, args: argparse.Namespace) -> None:
    texts = Texts(tokenizer, tokens=args.tokens)

    def whole(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode_batch_fast([text])[0].ids
        return ids

    for kind in ("shared", "unique"):
        cached = PromptTokenizer(tokenizer)
        for prefix in texts.prefixes():
            cached.encode(prefix)

        def cold(text: str, cached: PromptTokenizer = cached) -> list[int]:
            cached._pieces.clear()
            return cached.encode(text)

        ways = {
            "encode": whole,
            "no cache": PromptTokenizer(tokenizer, cache_tokens=0).encode,
            "cache": cached.encode if kind == "shared" else cold,
        }
        figures: dict[str, list[float]] = {way: [] for way in ways}
        for run in range(args.runs + 1):  # the first is the warm-up
            prompts = texts.prompts(args.texts, shared=kind == "shared", seed=run)
            expected = [whole(text) for text in prompts]
            for way, encode in ways.items():
                seconds = cpu_per_text(encode, prompts, expected)
                if run:
                    figures[way].append(seconds)
        base = statistics.median(figures["encode"])
        cells = [f"{statistics.median(values) * 1e6:9,.0f} µs {statistics.median(values) / base:5.2f}×"
                 for values in figures.values()]  # fmt: skip
        print(f"{name[:28]:28} {kind:7} " + "  ".join(cells) + f"   cuts: {cached.caches_pieces}")


def main() -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokenizer", type=existing_file, action="append", default=[], metavar="PATH", help="another tokenizer.json"
    )
    parser.add_argument("--tokens", type=positive_int, default=2048, help="tokens per prompt (2048)")
    parser.add_argument("--texts", type=positive_int, default=200, help="texts per pass (200)")
    parser.add_argument("--runs", type=positive_int, default=5, help="timed passes, after a warm-up (5)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one pass")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.texts, args.runs = 256, 20, 1
    for path in args.tokenizer:  # each checked before the first is measured
        try:
            Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            parser.error(f"argument --tokenizer: {str(path)!r} is not a tokenizer.json ({exc})")
    files = tokenizer_files(args.tokenizer)
    print(f"CPU per {args.tokens}-token text, median of {args.runs} passes of {args.texts}; ratio to encode")
    print(f"{'tokenizer':28} {'prompts':7} {'encode':>17}  {'no cache':>17}  {'cache':>17}")
    for name, path in files.items():
        measure(name, Tokenizer.from_file(str(path)), args)


if __name__ == "__main__":
    main()
