from __future__ import annotations

import importlib.util
import os
import random
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from prefixroute import ConfigurationError, InvalidPromptError, InvalidTypeError, Router
from prefixroute.adapters import tokenize
from prefixroute.adapters.tokenize import PromptTokenizer, TextRouter

CORPUS = [
    "You are a helpful assistant that answers questions about SQL databases.",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "Explain the difference between an inner join and a left join.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
] * 20


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real BPE tokenizer.json, trained here (tests never download one)."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_encode_matches_the_tokenizer_itself(tokenizer_file: Path) -> None:
    prompt_tokenizer = PromptTokenizer.from_file(tokenizer_file)
    text = CORPUS[0] + " " + CORPUS[2]
    assert prompt_tokenizer.encode(text) == Tokenizer.from_file(str(tokenizer_file)).encode(text).ids
    assert prompt_tokenizer.encode_batch([text, CORPUS[1]]) == [
        prompt_tokenizer.encode(text),
        prompt_tokenizer.encode(CORPUS[1]),
    ]


def test_text_prompts_sharing_a_system_prompt_share_a_backend(tokenizer_file: Path) -> None:
    text_router = TextRouter(Router(block_size=4), PromptTokenizer.from_file(tokenizer_file))
    system = " ".join(CORPUS[:3]) + " "
    backends = ["gpu0", "gpu1", "gpu2", "gpu3"]
    first = text_router.route(system + "How do I count rows?", backends)
    second = text_router.route(system + "What is an index?", backends)
    assert second.backend == first.backend
    assert second.reason == "prefix" and second.matched_tokens >= 8


def test_missing_or_malformed_files_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="never downloads"):
        PromptTokenizer.from_file(tmp_path / "absent.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigurationError, match="not a valid tokenizer.json"):
        PromptTokenizer.from_file(bad)


def test_wrong_types_are_type_errors(tokenizer_file: Path) -> None:
    prompt_tokenizer = PromptTokenizer.from_file(tokenizer_file)
    with pytest.raises(TypeError, match="text must be a str, not bytes$"):
        prompt_tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        prompt_tokenizer.encode_batch("one string")
    with pytest.raises(TypeError, match="must be a tokenizers.Tokenizer, not str$"):
        PromptTokenizer("tokenizer.json")  # type: ignore[arg-type]


# Piece cache: exactly the ids of one encode of the whole text, for every kind of tokenizer a model ships.

SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]"]


def _trained(tokenizer: Tokenizer, *, specials: list[str] = SPECIALS) -> Tokenizer:
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", *specials]))
    return tokenizer


def _id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None
    return token_id


def _byte_level(*, add_prefix_space: bool = False) -> Tokenizer:
    """GPT-2 / Qwen style: byte-level BPE, BOS and EOS added around every text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer = _trained(tokenizer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[("<s>", tokenizer.token_to_id("<s>")), ("</s>", tokenizer.token_to_id("</s>"))],
    )
    return tokenizer


def _llama3() -> Tokenizer:
    """Llama-3 style: a split regex then byte-level without its own regex, BOS before every text."""
    tokenizer = Tokenizer(models.BPE())
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer = _trained(tokenizer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def _word_piece() -> Tokenizer:
    """BERT style: WordPiece, lower-cased, ``[CLS] ... [SEP]`` around every text."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[CLS]", "[SEP]", *SPECIALS])
    )
    tokenizer.post_processor = processors.BertProcessing(
        ("[SEP]", _id(tokenizer, "[SEP]")), ("[CLS]", _id(tokenizer, "[CLS]"))
    )
    return tokenizer


def _metaspace(scheme: str) -> Tokenizer:
    """SentencePiece style (Llama 2, Mistral): ``▁`` marks words; ``first`` marks only the text's first."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    return _trained(tokenizer)


def _lowercase_word_level() -> Tokenizer:
    """A normalizer, word-level ids, an added token matched after normalization and one that strips spaces."""
    tokenizer = Tokenizer(
        models.WordLevel(
            {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["a", "b", "c", "hello", "world"])}}, unk_token="[UNK]"
        )
    )
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(
        [
            AddedToken("<|im_start|>", normalized=False),
            AddedToken("<|IM_END|>", normalized=True),
            AddedToken("[INST]", lstrip=True, rstrip=True, normalized=False),
        ]
    )
    tokenizer.add_tokens([AddedToken("<|im_start|>x", normalized=False), "hello world"])
    return tokenizer


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {
    "byte-level": _byte_level,
    "byte-level-prefix-space": lambda: _byte_level(add_prefix_space=True),
    "word-piece": _word_piece,
    "llama3": _llama3,
    "metaspace-first": lambda: _metaspace("first"),
    "metaspace-always": lambda: _metaspace("always"),
    "lowercase-word-level": _lowercase_word_level,
}
FRAGMENTS = [
    *SPECIALS,
    "<|IM_END|>",
    "<|im_start|>x",
    "hello world",
    "<|im",
    "start|>",
    "<",
    "|>",
    "hello",
    "World",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "a",
    "b c",
    "SELECT",
    "'s",
    ".",
    ",",
    "12345",
    "é",
    "日本",
    "🙂",
]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]()


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    add_special_tokens=st.booleans(),
    chunk_chars=st.sampled_from([512, 1, 3]),
)
def test_cached_pieces_give_exactly_the_ids_of_one_encode(
    any_tokenizer: Tokenizer, parts: list[str], add_special_tokens: bool, chunk_chars: int
) -> None:
    """``chunk_chars`` below the default cuts the texts between words at every gap, or every few characters."""
    text = "".join(parts)
    expected = any_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    with mock.patch.object(tokenize, "_CHUNK_CHARS", chunk_chars):
        for cache_tokens in (262_144, 4):  # 4: most pieces do not fit, the others are evicted at once
            prompt_tokenizer = PromptTokenizer(
                any_tokenizer, add_special_tokens=add_special_tokens, cache_tokens=cache_tokens
            )
            assert prompt_tokenizer.encode(text) == expected
            assert prompt_tokenizer.encode(text) == expected  # the second time from the cache


def test_which_tokenizers_cut_their_texts() -> None:
    def cuts(tokenizer: Tokenizer) -> tuple[bool, bool]:
        """(at special tokens, between words)"""
        prompt_tokenizer = PromptTokenizer(tokenizer)
        return bool(prompt_tokenizer._cuts), prompt_tokenizer._words

    assert {name: cuts(make()) for name, make in TOKENIZERS.items()} == {
        "byte-level": (True, True),
        "byte-level-prefix-space": (True, True),
        "word-piece": (True, True),
        "llama3": (True, True),
        "metaspace-first": (False, False),
        "metaspace-always": (True, True),
        # its only plain special token, <|im_start|>, is inside another added token; "hello world" holds a space
        "lowercase-word-level": (False, False),
    }
    assert not PromptTokenizer(_byte_level(), cache_tokens=0).caches_pieces
    assert PromptTokenizer(_bpe(normalizer=normalizers.NFKC()))._words
    assert PromptTokenizer(_bpe(pre_tokenizer=pre_tokenizers.Whitespace()))._words
    assert PromptTokenizer(_bpe(pre_tokenizer=pre_tokenizers.WhitespaceSplit()))._words
    # Not between words: a normalizer that is not per character, no pre-tokenizer or one that does not end words at
    # spaces (named so, or a Digits trained to merge across spaces, which the probes find), an added token that
    # strips spaces.
    for tokenizer in (
        _bpe(normalizer=normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "_")])),
        _bpe(normalizer=normalizers.Strip()),
        _bpe(pre_tokenizer=None),
        _bpe(pre_tokenizer=pre_tokenizers.ByteLevel(use_regex=False)),
        _bpe(pre_tokenizer=pre_tokenizers.Metaspace(split=False)),
        _bpe(pre_tokenizer=pre_tokenizers.Digits()),
        _bpe(added=AddedToken("cd", lstrip=True)),
    ):
        assert not PromptTokenizer(tokenizer)._words


PER_CHARACTER_NORMALIZERS: dict[str, Callable[[], normalizers.Normalizer]] = {
    "NFC": normalizers.NFC,
    "NFD": normalizers.NFD,
    "NFKC": normalizers.NFKC,
    "NFKD": normalizers.NFKD,
    "Lowercase": normalizers.Lowercase,
    "StripAccents": lambda: normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()]),
    "BertNormalizer": normalizers.BertNormalizer,
}


@pytest.mark.parametrize("name", sorted(PER_CHARACTER_NORMALIZERS))
def test_a_tokenizer_whose_normalizer_maps_each_character_apart_is_cut_between_words(name: str) -> None:
    """Unicode normal forms, lower case, accents stripped, BERT's: each maps a text piece by piece, so a long text is
    cut between words and its pieces cached, with exactly the ids of one encode (accents, ligatures, full-width
    letters and combining marks included)."""
    tokenizer = _bpe(normalizer=PER_CHARACTER_NORMALIZERS[name]())
    prompt_tokenizer = PromptTokenizer(tokenizer)
    assert prompt_tokenizer._words
    text = " ".join(["Caf\u00e9 na\u0131ve \ufb01ne \uff21BC Zu\u0308rich \u0130stanbul STRASSE stra\u00dfe"] * 40)
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids
    assert len(prompt_tokenizer._pieces) > 1


def test_a_pre_tokenizer_that_keeps_words_together_is_not_cut_between_them() -> None:
    """SuperBPE's released pre-tokenizer (a Split on digits, punctuation runs and trailing spaces, then byte-level
    without its own regex) keeps "in the" one pre-token, which its superword merge makes one token; no merge joins
    the words of the probe texts, so their ids alone did not tell."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("i", "n"), ("Ġ", "in"), ("t", "h"), ("th", "e"), ("Ġ", "the"), ("Ġin", "Ġthe")]
    for first, second in merges:
        vocab[first + second] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]{2,}[\r\n/]*| +(?!\S)"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    text = "a" * 509 + " in the"  # the first word gap after 512 characters is the one inside "in the"
    assert tokenizer.encode(text).ids[-1] == vocab["ĠinĠthe"]
    prompt_tokenizer = PromptTokenizer(tokenizer)
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids
    assert not prompt_tokenizer._words


def _bpe(
    *,
    normalizer: normalizers.Normalizer | None = None,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = pre_tokenizers.ByteLevel(),  # noqa: B008
    added: AddedToken | None = None,
) -> Tokenizer:
    """A BPE tokenizer trained on the corpus with the given normalizer and pre-tokenizer, then an added token."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer = _trained(tokenizer, specials=[])
    if added is not None:
        tokenizer.add_tokens([added])
    return tokenizer


def test_a_long_shared_text_prefix_is_encoded_once() -> None:
    """Plain text, no special tokens: the shared prefix's parts are cut between words at the same places."""
    tokenizer = _byte_level()
    prompt_tokenizer = PromptTokenizer(tokenizer)
    shared = " ".join(CORPUS)  # ~5,000 characters
    for question in ("What is a join?", "Why is the sky blue?"):
        assert prompt_tokenizer.encode(shared + question) == tokenizer.encode(shared + question).ids
    parts = list(prompt_tokenizer._pieces)  # in the order they were cached
    heads = "".join(parts[:-2])
    assert len(parts) >= 10 and shared.startswith(heads) and len(heads) > len(shared) - 600
    assert [part.endswith("?") for part in parts[-2:]] == [True, True]  # each text's own tail, the rest shared
    assert all(len(part) <= 600 for part in parts)


def _real_tokenizer_files() -> list[Path]:
    """Real models' tokenizer.json files that LiteLLM ships (DeepSeek's, Anthropic's), when it is installed."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI") == "true":
            pytest.fail("litellm is not installed: CI tests the real tokenizers it ships")
        return []
    folder = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
    return sorted(folder.glob("*.json"))


@pytest.mark.parametrize("path", _real_tokenizer_files(), ids=lambda path: path.stem)
def test_real_tokenizers_cut_texts_to_exactly_their_own_ids(path: Path) -> None:
    """Real models' tokenizers on real text (this repository's docs and code), cut at special tokens and words."""
    tokenizer = Tokenizer.from_file(str(path))
    texts = [file.read_text(encoding="utf-8") for file in sorted(Path(__file__).parents[2].glob("docs/*.md"))]
    rng = random.Random(0)
    for add_special_tokens in (True, False):
        prompt_tokenizer = PromptTokenizer(tokenizer, add_special_tokens=add_special_tokens)
        assert prompt_tokenizer._words
        for _ in range(60):
            text = rng.choice(texts)
            start = rng.randrange(len(text))
            sample = text[start : start + rng.randrange(600, 6000)]
            expected = tokenizer.encode(sample, add_special_tokens=add_special_tokens).ids
            assert prompt_tokenizer.encode(sample) == expected
            assert prompt_tokenizer.encode(sample) == expected


def test_a_shared_system_prompt_is_encoded_once() -> None:
    tokenizer = _byte_level()
    prompt_tokenizer = PromptTokenizer(tokenizer)
    system = "<|im_start|>system\n" + " ".join(CORPUS[:4]) + "<|im_end|>\n"
    for question in ("What is a join?", "Why is the sky blue?"):
        text = system + f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids
    cached = list(prompt_tokenizer._pieces)
    assert cached.count("system\n" + " ".join(CORPUS[:4])) == 1
    assert sorted(piece for piece in cached if piece.startswith("user\n")) == [
        "user\nWhat is a join?",
        "user\nWhy is the sky blue?",
    ]


def test_pieces_of_few_ids_for_their_length_are_not_cached() -> None:
    """Was: whitespace between two special tokens, which BERT's pre-tokenizer drops, was cached with no ids, so
    weighed nothing and was never evicted: texts that differed only there grew the cache without bound (20,000
    entries for a cache of 1,000 ids, and each 100 kB run of spaces kept its 100 kB)."""
    tokenizer = _word_piece()
    prompt_tokenizer = PromptTokenizer(tokenizer, cache_tokens=1000)
    assert prompt_tokenizer.caches_pieces
    for i in range(2000):
        text = f"<|im_start|>{CORPUS[0]}<|im_end|>{' ' * (i + 1)}<|im_start|>{CORPUS[1]}<|im_end|>"
        assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids
    assert len(prompt_tokenizer._pieces) <= 3  # the two texts' pieces (and nothing for the runs of spaces)
    assert all(len(piece) <= 64 * len(ids) for piece, ids in prompt_tokenizer._pieces.items())


@pytest.mark.parametrize("cache_tokens", [-1, 1.5, True, "8"])
def test_cache_size_is_checked(cache_tokens: object) -> None:
    with pytest.raises(ConfigurationError, match="cache_tokens must be a non-negative int") as refused:
        PromptTokenizer(_byte_level(), cache_tokens=cache_tokens)  # type: ignore[arg-type]
    assert str(refused.value).endswith(f"not {cache_tokens!r}")  # the value sent


def test_threads_share_the_cache_safely() -> None:
    tokenizer = _byte_level()
    texts = [
        f"<|im_start|>system\n{CORPUS[s % 4]}<|im_end|>\n<|im_start|>user\n{CORPUS[q % 4]} {q}<|im_end|>\n"
        for s in range(4)
        for q in range(12)
    ]
    expected = [tokenizer.encode(text).ids for text in texts]
    prompt_tokenizer = PromptTokenizer(tokenizer, cache_tokens=64)  # a few pieces at a time: constant eviction
    failures: list[int] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:

        def work(offset: int) -> None:
            for i in range(200):
                n = (i + offset) % len(texts)
                if prompt_tokenizer.encode(texts[n]) != expected[n]:
                    failures.append(n)

        threads = [threading.Thread(target=work, args=(k * 7,)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    assert sum(map(len, prompt_tokenizer._pieces.values())) <= 64


@pytest.mark.parametrize(("text", "position"), [("a \ud800 b", 2), ("<|im_start|>user\nhi\udfff<|im_end|>", 19)])
def test_a_lone_surrogate_is_a_clear_prompt_error(text: str, position: int) -> None:
    """JSON can carry one (a ``\\ud800`` escape); the library itself only says its input has the wrong type. Both
    texts: one encoded whole, one cut at its special tokens (the position is in the whole text, not in its piece)."""
    prompt_tokenizer = PromptTokenizer(_byte_level())
    assert prompt_tokenizer.caches_pieces
    with pytest.raises(InvalidPromptError) as refused:
        prompt_tokenizer.encode(text)
    code = ord(text[position])
    assert str(refused.value) == (
        f"the text has a lone surrogate (U+{code:04X}) at character {position}: send valid Unicode text"
    )
    with pytest.raises(InvalidPromptError, match="lone surrogate"):
        prompt_tokenizer.encode_batch(["fine", text])


def _word_level(words: list[str], *, unknown: str = "[UNK]") -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_tokenizers_that_cannot_be_cut_as_they_seem_give_their_own_ids() -> None:
    reading = _word_level(["[UNK]", "system", "hello"])
    reading.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    reading.encode_special_tokens = True  # its special tokens are read as text, not matched
    text = "<|im_start|>system hello<|im_end|>"
    assert PromptTokenizer(reading).encode(text) == reading.encode(text).ids
    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"Q ": 95}
    merged = Tokenizer(models.BPE(vocab=vocab, merges=[("Q", " ")]))
    merged.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # the space ends the word
    text = "a" * 510 + "FAQ about"
    assert PromptTokenizer(merged).encode(text) == merged.encode(text).ids


def test_a_tokenizer_that_cannot_encode_or_a_huge_added_token_is_handled_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot encode a short probe text"):
        PromptTokenizer(_word_level(["hello"]))  # its unknown token is not in its vocabulary
    path = tmp_path / "tokenizer.json"
    _word_level(["hello"]).save(str(path))
    with pytest.raises(ConfigurationError) as refused:  # was: the file went unnamed
        PromptTokenizer.from_file(path)
    assert str(refused.value).startswith(f"tokenizer file {str(path)!r}: the tokenizer cannot encode a short probe")
    huge = _word_level(["[UNK]", "a"])
    long_token = "".join(chr(0x4E00 + i) for i in range(3000))  # every substring kept: ~10^10 characters
    huge.add_special_tokens([AddedToken(long_token, normalized=False), "<s>"])
    prompt = PromptTokenizer(huge)
    text = "a <s> a " + long_token + " a"
    assert prompt.encode(text) == huge.encode(text).ids


class _SpaceSplit:
    """A custom (Python) pre-tokenizer: words at single spaces."""

    def pre_tokenize(self, pretok: Any) -> None:
        pretok.split(lambda _i, text: text.split(" ", "removed"))


def test_a_tokenizer_with_a_custom_pre_tokenizer_encodes_whole_texts() -> None:
    """Its configuration cannot be serialised (the library raises a bare Exception from to_str()): no cuts, no error."""
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(_SpaceSplit())
    prompt_tokenizer = PromptTokenizer(tokenizer)
    assert not prompt_tokenizer.caches_pieces
    text = " ".join(["a", "b"] * 400)
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids == [0, 1] * 400


def test_from_file_passes_its_options_on(tmp_path: Path) -> None:
    """By default the post-processor's ids go around the text, as vLLM encodes a prompt."""
    tokenizer = _byte_level()  # <s> ... </s> around every text
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    text = "<|im_start|>user\n" + CORPUS[0] + "<|im_end|>"
    assert PromptTokenizer.from_file(path).encode(text) == tokenizer.encode(text).ids
    bare = PromptTokenizer.from_file(path, add_special_tokens=False).encode(text)
    assert bare == tokenizer.encode(text, add_special_tokens=False).ids != tokenizer.encode(text).ids
    assert PromptTokenizer.from_file(path).caches_pieces
    assert not PromptTokenizer.from_file(path, cache_tokens=0).caches_pieces


def test_from_file_says_which_file_is_missing_or_no_tokenizer(tmp_path: Path) -> None:
    absent = tmp_path / "absent.json"
    with pytest.raises(ConfigurationError, match=f"tokenizer file {str(absent)!r} not found: pass the path"):
        PromptTokenizer.from_file(absent)
    with pytest.raises(ConfigurationError, match=f"tokenizer file {str(tmp_path)!r} is not a regular file: pass"):
        PromptTokenizer.from_file(tmp_path)  # a folder
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ConfigurationError, match=f"^{str(bad)!r} is not a valid tokenizer.json"):
        PromptTokenizer.from_file(bad)


def test_a_tokenizer_path_of_the_wrong_type_or_blank_is_refused_saying_so() -> None:
    with pytest.raises(TypeError, match="a tokenizer path is a str or a path, not int$"):
        PromptTokenizer.from_file(5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="must name a tokenizer.json or a model folder, not ' '$"):
        PromptTokenizer.from_file(" ")


def test_a_cached_piece_is_not_encoded_again() -> None:
    """A system prompt that many texts share is encoded once, and a piece of exactly ``cache_tokens`` ids is kept."""
    tokenizer = _byte_level()
    system = "<|im_start|>system\n" + " ".join(CORPUS[:4]) + "<|im_end|>"
    size = len(tokenizer.encode(system[len("<|im_start|>") : -len("<|im_end|>")], add_special_tokens=False).ids)
    for cache_tokens in (262_144, size):
        prompt_tokenizer = PromptTokenizer(tokenizer, cache_tokens=cache_tokens)
        assert prompt_tokenizer.encode(system) == tokenizer.encode(system).ids
        with mock.patch.object(prompt_tokenizer, "_encode", wraps=prompt_tokenizer._encode) as encode:
            assert prompt_tokenizer.encode(system) == tokenizer.encode(system).ids
        assert encode.call_count == 0


def test_a_tokenizer_cut_at_special_tokens_only_is_not_cut_between_words() -> None:
    """Its long pieces are encoded whole: a space ends no word for it, so a cut there would change the ids."""
    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"Q ": 95}
    merged = Tokenizer(models.BPE(vocab=vocab, merges=[("Q", " ")]))
    merged.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # the space ends the word
    merged.add_special_tokens(["<s>"])
    prompt_tokenizer = PromptTokenizer(merged)
    assert prompt_tokenizer._cuts and not prompt_tokenizer._words
    text = "<s>" + "a" * 510 + "FAQ about"
    assert prompt_tokenizer.encode(text) == merged.encode(text).ids


def test_texts_are_routed_in_their_namespace() -> None:
    text_router = TextRouter(Router(block_size=4), PromptTokenizer(_byte_level()))
    text = " ".join(CORPUS[:3])
    backends = ["gpu0", "gpu1"]
    text_router.route(text, backends, namespace="lora-a")
    assert text_router.route(text, backends, namespace="lora-b").reason != "prefix"
    assert text_router.route(text, backends).reason != "prefix"
    assert text_router.route(text, backends, namespace="lora-a").reason == "prefix"


def test_chat_messages_are_serialised_role_by_role_then_the_assistant_s_turn() -> None:
    """``<|role|>\\ncontent\\n`` per message (docs/adapters.md): a list content joined from its parts' string texts,
    any other content, or none, empty; a message without a role, or whose role is no string, has an empty one (it
    was rendered with Python's repr, ``<|None|>``, so a JSON null role grouped apart from a missing one)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                     "b", {"type": "text", "text": 5}, {"type": "text", "text": "c"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"arguments": "{}"}}]},
        {"role": "tool", "content": 5},
        {"content": "x"},
        {"role": None, "content": "y"},
        {"role": {"name": "user"}, "content": "z"},
        {"role": "user"},
    ]  # fmt: skip
    blocks = ["<|system|>\nBe brief.\n", "<|user|>\nac\n", "<|assistant|>\n\n", "<|tool|>\n\n", "<||>\nx\n",
              "<||>\ny\n", "<||>\nz\n"]  # fmt: skip
    assert tokenize.serialise_chat(messages) == "".join([*blocks, "<|user|>\n\n", "<|assistant|>\n"])


def test_chat_messages_that_are_no_list_of_objects_are_refused_naming_what_was_sent() -> None:
    with pytest.raises(TypeError, match="objects, not str$"):
        tokenize.serialise_chat("hello")  # type: ignore[arg-type]
    with pytest.raises(InvalidPromptError, match="^chat message 1 is a int, not an object"):
        tokenize.serialise_chat([{"role": "user", "content": "a"}, 5])  # type: ignore[list-item]


def test_tokenizers_the_probe_texts_pass_are_still_not_cut_between_words_when_their_config_says_so() -> None:
    """An added token that holds a space, and a Replace inside a normalizer Sequence (the form Llama 2's takes), where
    the probe texts hold nothing either changes: a cut between words would change the ids of the texts that do."""
    cases = [
        (_bpe(added=AddedToken("hello world")), "w" * 507 + " hello world"),  # the first gap after 512: in the token
        (_bpe(normalizer=normalizers.Sequence([normalizers.Replace("w z", "wz")])), "a" * 511 + "w zeta"),
    ]
    for tokenizer, text in cases:
        prompt_tokenizer = PromptTokenizer(tokenizer)
        assert not prompt_tokenizer._words
        assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids


@pytest.mark.parametrize("side", ["lstrip", "rstrip"])
def test_a_special_token_that_strips_the_spaces_on_one_side_is_no_cut(side: str) -> None:
    tokenizer = _byte_level()
    tokenizer.add_special_tokens([AddedToken("<|eot|>", normalized=False, **{side: True})])
    prompt_tokenizer = PromptTokenizer(tokenizer)
    assert "<|eot|>" not in prompt_tokenizer._cuts and "<|im_end|>" in prompt_tokenizer._cuts
    text = "<|im_start|>user a <|eot|> b<|im_end|>"
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids


def test_a_special_token_is_no_cut_where_another_added_token_holds_or_overlaps_it_or_over_256_characters() -> None:
    """The library matches added tokens leftmost-longest, so a text cut at such a token could be matched otherwise
    there: of these special tokens only the one of exactly 256 characters, which overlaps no other, is a cut."""
    plain = "«" + "y" * 254 + "»"  # 256 characters, no end of it also its start
    over = "<" + "z" * 255 + ">"  # 257
    held = {  # special token: the added token that holds it or overlaps it, of up to or over 256 characters
        "</s>": "<" + "v" * 150 + "</s>" + "v" * 150 + ">",
        "<s>": "<" + "x" * 125 + "<s>" + "x" * 126 + ">",
        "[INST]": "<" + "w" * 299 + "[",  # a long one's end is the token's start
        "§": "<§>",  # a one-character token inside another
        "</t>": "x</t>",  # the end of another
        "(a)": "x(",  # another's end is the token's start (by one character)
        "{b}": "}y",  # the token's end is another's start
    }
    tokenizer = _word_level(["[UNK]", "a", "x", "y"])
    holding = "q§"  # holds a one-character token, "§", at its end
    specials = [over, *held, holding, plain]
    tokenizer.add_special_tokens([AddedToken(token, normalized=False) for token in specials])
    tokenizer.add_tokens([AddedToken(other, normalized=False) for other in held.values()])
    prompt_tokenizer = PromptTokenizer(tokenizer)
    assert len(plain) == 256 and list(prompt_tokenizer._cuts) == [plain]
    text = " a ".join([*specials, *held.values(), "x(a)", "{b}y", held["[INST]"] + "INST]", "a"])
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids


def test_a_long_text_gets_the_post_processor_s_ids_with_the_cache_off() -> None:
    """With no cut to make, a text over 512 characters is encoded whole, the ids around it added by the library."""
    tokenizer = _byte_level()  # <s> ... </s> around every text
    text = " ".join(CORPUS)
    assert PromptTokenizer(tokenizer, cache_tokens=0).encode(text) == tokenizer.encode(text).ids


def test_a_tokenizer_without_special_tokens_cuts_a_long_text_between_words() -> None:
    tokenizer = _word_level(["[UNK]", "a", "b"])  # no added token: nothing to cut at but word gaps
    prompt_tokenizer = PromptTokenizer(tokenizer)
    text = " ".join(["a", "b", "c"] * 300)
    assert prompt_tokenizer.caches_pieces and not prompt_tokenizer._cuts
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids
    assert len(prompt_tokenizer._pieces) > 1


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_a_tokenizer_that_truncates_or_pads_encodes_whole_texts(setting: str) -> None:
    """Each piece would be truncated or padded on its own: the text is encoded whole, as the library would."""
    tokenizer = _byte_level()
    if setting == "truncation":
        tokenizer.enable_truncation(max_length=24)
    else:
        tokenizer.enable_padding(length=600)
    prompt_tokenizer = PromptTokenizer(tokenizer)
    assert not prompt_tokenizer.caches_pieces
    text = "<|im_start|>system\n" + " ".join(CORPUS[:8]) + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>"
    assert prompt_tokenizer.encode(text) == tokenizer.encode(text).ids


# -- edges (each test was written against a mutant of adapters/tokenize.py that the suite let through, or a hostile
# input that got a wrong answer or an error outside prefixroute's tree) --


def _one_id_a_character() -> Tokenizer:
    """Every printable ASCII character one id, cut at ``<s>`` only (a space ends no word for it): a piece of n
    characters is n ids and is never cut between words."""
    tokenizer = Tokenizer(models.BPE(vocab={chr(c): c - 32 for c in range(32, 127)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.add_special_tokens(["<s>"])
    return tokenizer


def _encoded_again(prompt_tokenizer: PromptTokenizer, text: str) -> bool:
    """Whether a second encode of ``text`` (after a first) calls the library, i.e. its piece was not kept."""
    expected = prompt_tokenizer.encode(text)
    with mock.patch.object(prompt_tokenizer, "_encode", wraps=prompt_tokenizer._encode) as encode:
        assert prompt_tokenizer.encode(text) == expected
    return encode.call_count > 0


def test_the_default_cache_keeps_a_piece_of_262_144_ids_and_no_longer_one(tmp_path: Path) -> None:
    """The default ``cache_tokens=262_144`` (the signature's), for the constructor and from_file alike."""
    tokenizer = _one_id_a_character()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    makers: list[Callable[[], PromptTokenizer]] = [
        lambda: PromptTokenizer(tokenizer),
        lambda: PromptTokenizer.from_file(path),
    ]
    for make in makers:
        prompt_tokenizer = make()
        assert prompt_tokenizer.caches_pieces and not prompt_tokenizer._words
        assert not _encoded_again(prompt_tokenizer, "<s>" + "a" * 262_144)
        assert _encoded_again(prompt_tokenizer, "<s>" + "b" * 262_145)


def test_a_piece_of_more_ids_than_cache_tokens_is_not_kept() -> None:
    prompt_tokenizer = PromptTokenizer(_one_id_a_character(), cache_tokens=1)
    assert not _encoded_again(prompt_tokenizer, "<s>a")
    assert _encoded_again(prompt_tokenizer, "<s>ab")


def test_from_file_s_refusal_of_a_missing_file_says_what_to_pass_word_for_word(tmp_path: Path) -> None:
    absent = tmp_path / "absent.json"
    with pytest.raises(ConfigurationError) as refused:
        PromptTokenizer.from_file(absent)
    assert str(refused.value) == (
        f"tokenizer file {str(absent)!r} not found: pass the path of the model's local tokenizer.json "
        "(prefixroute never downloads tokenizers)"
    )


def test_encode_batch_takes_a_sequence_of_str_and_names_the_text_that_is_not_one() -> None:
    """An iterator passed the old type check, which used it up: the batch was encoded as empty, ``[]``."""
    tokenizer = _byte_level()
    prompt_tokenizer = PromptTokenizer(tokenizer)
    texts = [CORPUS[0], CORPUS[1]]
    expected = [encoding.ids for encoding in tokenizer.encode_batch(texts)]
    assert prompt_tokenizer.encode_batch(texts) == prompt_tokenizer.encode_batch(tuple(texts)) == expected
    assert prompt_tokenizer.encode_batch([]) == []
    for texts_given, kind in (
        (iter(texts), "list_iterator"),
        ("one string", "str"),
        (b"bytes", "bytes"),
        (None, "NoneType"),
    ):
        with pytest.raises(InvalidTypeError) as refused:
            prompt_tokenizer.encode_batch(texts_given)  # type: ignore[arg-type]
        assert str(refused.value) == f"texts must be a sequence of str (a list or tuple), not {kind}"
    with pytest.raises(InvalidTypeError) as refused:
        prompt_tokenizer.encode_batch(["fine", 5])  # type: ignore[list-item]
    assert str(refused.value) == "texts[1] must be a str, not int"


def test_encode_batch_names_the_text_that_holds_a_lone_surrogate() -> None:
    with pytest.raises(InvalidPromptError) as refused:
        PromptTokenizer(_byte_level()).encode_batch(["fine", "also fine", "a \ud800 b"])
    assert str(refused.value) == "texts[2] has a lone surrogate (U+D800) at character 2: send valid Unicode text"


def test_text_router_refuses_a_router_or_tokenizer_of_the_wrong_type_saying_what_it_takes() -> None:
    """They were taken as given, and the first route() raised an AttributeError from outside prefixroute's tree."""
    tokenizer = _byte_level()
    with pytest.raises(InvalidTypeError) as refused:
        TextRouter("router", PromptTokenizer(tokenizer))  # type: ignore[arg-type]
    assert str(refused.value) == "router must be a prefixroute.Router, not str"
    with pytest.raises(InvalidTypeError) as refused:
        TextRouter(Router(), tokenizer)  # type: ignore[arg-type]
    assert str(refused.value) == (
        "tokenizer must be a PromptTokenizer, not Tokenizer (wrap a tokenizers.Tokenizer: PromptTokenizer(tokenizer))"
    )
    with pytest.raises(InvalidTypeError) as refused:
        TextRouter(Router(), "tokenizer.json")  # type: ignore[arg-type]
    assert str(refused.value) == "tokenizer must be a PromptTokenizer, not str"
    router, prompt_tokenizer = Router(), PromptTokenizer(tokenizer)
    text_router = TextRouter(router, prompt_tokenizer)
    assert text_router.router is router and text_router.tokenizer is prompt_tokenizer


class _BytesPath(os.PathLike):  # type: ignore[type-arg]
    def __fspath__(self) -> bytes:
        return b"tokenizer.json"


def test_a_path_object_that_gives_bytes_is_refused_as_a_tokenizer_path() -> None:
    """``Path()`` raised its own TypeError for it, outside prefixroute's tree."""
    with pytest.raises(InvalidTypeError) as refused:
        PromptTokenizer.from_file(_BytesPath())
    assert str(refused.value) == "a tokenizer path is a str or a path, not _BytesPath (its os.fspath() is bytes)"
