"""Defects the adapters' fuzz harness (test_fuzz_adapters.py) found: each case failed before its fix."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from prefixroute import ConfigurationError, InvalidPromptError, InvalidTypeError, Router
from prefixroute.adapters.proxy import ByteEncoder, Proxy, TokenizerEncoder
from prefixroute.adapters.serve import PromptEncoder, Sidecar, release_ids
from prefixroute.adapters.tokenize import PromptTokenizer, serialise_chat
from prefixroute.adapters.urls import listen_host

_URL = ["http://127.0.0.1:8000"]


@pytest.mark.parametrize(
    ("option", "value"),
    [("retries", "x"), ("retries", None), ("retries", True), ("retries", 1.5), ("retries", math.nan),
     ("max_failures", None), ("cooldown", None), ("cooldown", math.inf),
     ("cooldown", "10"), ("connect_timeout", None), ("connect_timeout", 10**400), ("connect_timeout", True)],
)  # fmt: skip
def test_proxy_numeric_options_are_configuration_errors_when_given_never_raw_type_errors(
    option: str, value: object
) -> None:
    with pytest.raises(ConfigurationError, match=option):
        Proxy(Router(), _URL, **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("retries", [-1, 17, 99999999999999999999999])
def test_proxy_retries_past_16_are_refused_with_the_bound(retries: int) -> None:
    # Was: any int >= 0, 10**23 too: a request kept being resent while the fleet was down.
    with pytest.raises(ConfigurationError, match=r"retries must be an int in \[0, 16\]"):
        Proxy(Router(), _URL, retries=retries)
    assert Proxy(Router(), _URL, retries=16).stats().retries == 0  # the bound itself is taken


@pytest.mark.parametrize(
    ("option", "value"),
    [("backends", None), ("backends", "http://127.0.0.1:8000"), ("backends", [5]), ("encoder", 5),
     ("fleet", "gpu0"), ("base_models", True), ("base_models", "llama"), ("base_models", [None]), ("clock", 5)],
)  # fmt: skip
def test_proxy_options_of_the_wrong_type_are_type_errors_of_the_tree_when_given(option: str, value: object) -> None:
    options: dict[str, object] = {"backends": _URL, option: value}
    with pytest.raises(InvalidTypeError, match=option):
        Proxy(Router(), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [("lease", True), ("lease", 10**400), ("models", "llama"), ("models", True),
     ("base_models", None), ("base_models", 5), ("max_body_bytes", "x"), ("max_body_bytes", 0),
     ("max_body_bytes", True)],
)  # fmt: skip
def test_sidecar_nonsense_options_are_configuration_errors_when_given(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=option):
        Sidecar(Router(), **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [("backends", None), ("backends", "http://127.0.0.1:8000"), ("encoder", ByteEncoder()), ("healthy", 5),
     ("clock", None)],
)  # fmt: skip
def test_sidecar_options_of_the_wrong_type_are_type_errors_of_the_tree_when_given(option: str, value: object) -> None:
    with pytest.raises(InvalidTypeError, match=option):
        Sidecar(Router(), **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("messages", [None, 5, "hi", b"hi"])
def test_chat_messages_that_are_no_list_are_type_errors_of_the_tree(model_dir: Path, messages: object) -> None:
    tokenizer = PromptTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    for encoder in (ByteEncoder(), TokenizerEncoder(tokenizer), PromptEncoder(model_dir)):
        with pytest.raises(InvalidTypeError, match="chat messages"):
            encoder.encode_chat(messages)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        serialise_chat(messages)  # type: ignore[arg-type]


@pytest.mark.parametrize("message", [None, "hi", ["user", "hi"]])
def test_a_chat_message_that_is_no_object_is_an_invalid_prompt(model_dir: Path, message: object) -> None:
    tokenizer = PromptTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    for encoder in (ByteEncoder(), TokenizerEncoder(tokenizer), PromptEncoder(model_dir)):
        with pytest.raises(InvalidPromptError, match="chat message 0"):
            encoder.encode_chat([message])  # type: ignore[list-item]


def test_prompt_encoder_chat_errors_stay_value_errors_as_documented_and_are_of_the_tree(model_dir: Path) -> None:
    with pytest.raises(InvalidPromptError, match="role"):
        PromptEncoder(model_dir).encode_chat([{"role": None, "content": "hi"}])


def test_byte_encoder_and_tokenizer_encoder_refuse_what_is_no_text_or_no_tokenizer() -> None:
    with pytest.raises(InvalidTypeError, match="text must be a str"):
        ByteEncoder().encode(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="PromptTokenizer"):
        TokenizerEncoder(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", [None, 5, ["tokenizer.json"]])
def test_tokenizer_paths_of_the_wrong_type_are_type_errors_of_the_tree(path: object) -> None:
    with pytest.raises(InvalidTypeError, match="tokenizer path"):
        PromptTokenizer.from_file(path)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="tokenizer path"):
        PromptEncoder(path)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["x" * 5000, "/tmp/" + "y" * 300 + "/tokenizer.json"])
def test_a_path_the_os_cannot_look_up_is_a_missing_tokenizer_not_an_os_error(path: str) -> None:
    with pytest.raises(ConfigurationError, match="not found"):
        PromptTokenizer.from_file(path)
    with pytest.raises(ConfigurationError, match="not found"):
        PromptEncoder(path)


def test_a_tokenizer_with_an_empty_vocabulary_is_refused_at_load(tmp_path: Path) -> None:
    """A BPE tokenizer.json with no vocabulary loaded: every prompt encoded to [] (routed as zero tokens, never
    matching a prefix) and max_token_id was -1, or the config's vocab_size - 1."""
    from tokenizers import models

    Tokenizer(models.BPE({}, [])).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    with pytest.raises(ConfigurationError) as refused:
        PromptEncoder(tmp_path)
    assert str(refused.value) == (
        f"{str(tmp_path / 'tokenizer.json')!r} has an empty vocabulary, which encodes every prompt to no tokens: pass "
        "the model's own tokenizer.json"
    )


def test_encode_batch_refuses_what_is_not_iterable(model_dir: Path) -> None:
    tokenizer = PromptTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    with pytest.raises(InvalidTypeError, match="sequence of str"):
        tokenizer.encode_batch(None)  # type: ignore[arg-type]


def test_release_ids_and_listen_host_refuse_the_wrong_type_with_errors_of_the_tree() -> None:
    for datagram, kind in ((None, "NoneType"), ("prefixroute_finish=a", "str")):
        with pytest.raises(InvalidTypeError, match=f"datagram must be bytes, not {kind}"):
            release_ids(datagram)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="host"):
        listen_host(True)  # type: ignore[arg-type]


def test_an_ipv6_address_in_brackets_as_a_url_writes_it_is_the_address() -> None:
    # Was passed on as "[::1]": "cannot listen on [::1]:P: Name or service not known", or [[::1]]:P in a message.
    assert listen_host("[::1]") == "::1" and listen_host("[0:0::1]") == "::1" and listen_host("::1") == "::1"
    for text in ("[gpu0]", "[127.0.0.1]", "[]"):
        with pytest.raises(argparse.ArgumentTypeError, match="an IPv6 address between the brackets"):
            listen_host(text)
