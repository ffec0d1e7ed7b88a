from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from prefixroute import ConfigurationError, Router
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
    with pytest.raises(TypeError):
        prompt_tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        prompt_tokenizer.encode_batch("one string")
    with pytest.raises(TypeError):
        PromptTokenizer("tokenizer.json")  # type: ignore[arg-type]
