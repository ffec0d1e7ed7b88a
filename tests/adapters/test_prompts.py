"""The token ids an OpenAI request routes on, encoded off the event loop when its text is long."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from prefixroute import InvalidPromptError, InvalidTypeError, Router
from prefixroute.adapters.proxy.prompts import (
    INLINE_TEXT,
    BadRequest,
    ByteEncoder,
    TokenizerEncoder,
    check_encoder,
    request_tokens,
    request_tokens_async,
)
from prefixroute.adapters.serve.contract import BadRequest as ServeBadRequest
from prefixroute.adapters.serve.contract import openai_prompt, request_int
from prefixroute.adapters.tokenize import PromptTokenizer, serialise_chat

from .conftest import LoopNoting, tool_call_conversation

LONG = "y" * INLINE_TEXT


@pytest.mark.parametrize(
    ("body", "chat", "on_loop"),
    [
        ({"prompt": "short"}, False, True),
        ({"prompt": LONG}, False, True),  # not over the limit
        ({"prompt": LONG + "y"}, False, False),
        ({"prompt": [LONG + "y", "b"]}, False, False),  # a batch routes on its first prompt
        ({"prompt": ["b", LONG + "y"]}, False, True),
        ({"messages": [{"role": "user", "content": LONG}]}, True, False),  # the message's markers count too
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONG}] * 2}]}, True, False),
        ({"messages": [{"role": "user", "content": "hi"}] * 100}, True, True),
        # every message's text counts, a list content's parts added to the others' text
        (
            {
                "messages": [
                    {"role": "user", "content": LONG},
                    {"role": "user", "content": [{"type": "text", "text": "b"}]},
                ]
            },
            True,
            False,
        ),
        # and each message's markers count 16: over the limit with these alone
        ({"messages": [{"content": ""}] * (INLINE_TEXT // 16)}, True, True),
        ({"messages": [{"content": ""}] * (INLINE_TEXT // 16 + 1)}, True, False),
        # as does what else a chat template renders: a tool call's arguments
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": LONG}}]}]},
            True,
            False,
        ),
    ],
)
def test_long_text_is_encoded_on_a_worker_thread(body: dict[str, Any], chat: bool, on_loop: bool) -> None:
    encoder = LoopNoting()
    tokens = asyncio.run(request_tokens_async(body, chat=chat, encoder=encoder))
    assert encoder.on_loop == [on_loop]
    assert tokens == asyncio.run(request_tokens_async(body, chat=chat, encoder=ByteEncoder()))


def test_a_python_caller_s_cyclic_or_shared_message_is_measured_each_part_once() -> None:
    """The LiteLLM hook and the Ray Serve router take bodies a Python caller built: a message that holds itself, or
    a list shared 2**200 times over, must not loop forever (nor exponentially long) while its text is measured."""
    cyclic: dict[str, Any] = {"role": "user", "content": "hi"}
    cyclic["again"] = cyclic
    shared: list[Any] = ["x"]
    for _ in range(200):
        shared = [shared, shared]
    long_cyclic: dict[str, Any] = {"role": "user", "content": LONG}
    long_cyclic["again"] = [long_cyclic]
    cases = [(cyclic, True), ({"role": "user", "content": "hi", "tool_calls": shared}, True), (long_cyclic, False)]
    for message, on_loop in cases:
        encoder = LoopNoting()
        done: list[list[int]] = []
        body = {"messages": [message]}
        worker = threading.Thread(target=_route_into, args=(body, encoder, done), daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert done, "measuring the message's text did not end"
        assert encoder.on_loop == [on_loop]


def _route_into(body: dict[str, Any], encoder: LoopNoting, done: list[list[int]]) -> None:
    done.append(asyncio.run(request_tokens_async(body, chat=True, encoder=encoder)))


@pytest.mark.parametrize("body", [None, [LONG], {"prompt": 5}, {"messages": LONG}, {"messages": [LONG * 2]}])
def test_what_cannot_be_read_is_refused_as_inline(body: object) -> None:
    chat = isinstance(body, dict) and "messages" in body
    with pytest.raises(BadRequest):
        asyncio.run(request_tokens_async(body, chat=chat, encoder=ByteEncoder()))


# request_tokens: what each shape of body routes on, and what it is refused with (docs/adapters.md, the proxy).

VLLM_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def _refusal(body: object, *, chat: bool = False, max_token_id: int | None = None) -> str:
    """The message of the BadRequest ``body`` is refused with, checked to be the default 400 ``BadRequestError``."""
    with pytest.raises(BadRequest) as refused:
        request_tokens(body, chat=chat, encoder=ByteEncoder(), max_token_id=max_token_id)
    assert (refused.value.status, refused.value.kind) == (400, "BadRequestError")
    return str(refused.value)


@pytest.mark.parametrize("max_token_id", [None, 7])
def test_a_prompt_of_token_ids_routes_on_them_as_sent(max_token_id: int | None) -> None:
    ids = [5, 0, 7, 7]
    assert request_tokens({"prompt": ids}, chat=False, encoder=ByteEncoder(), max_token_id=max_token_id) == ids
    assert request_tokens({"prompt": [ids]}, chat=False, encoder=ByteEncoder(), max_token_id=max_token_id) == ids


@pytest.mark.parametrize(
    "prompt",
    [["first", "second"], [[1, 2], [3]], [[1, 2], [3, True], [1.5]]],
)
def test_a_batch_routes_on_its_first_prompt(prompt: list[Any]) -> None:
    first = prompt[0]
    expected = ByteEncoder().encode(first) if isinstance(first, str) else first
    for max_token_id in (None, 3):
        assert request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder(), max_token_id=max_token_id) == (
            expected
        )


@pytest.mark.parametrize("prompt", [["first", [1, 2]], [[1, 2], "second"]])
def test_a_batch_that_mixes_texts_and_lists_is_refused_as_vllm_refuses_it(prompt: list[Any]) -> None:
    # Was routed on its first prompt; vLLM's request model (pydantic's union of list[int], list[list[int]], str and
    # list[str]) takes no member for it and answers 400.
    with pytest.raises(BadRequest, match="^'prompt' as a batch holds strings or lists of token ids, nothing else$"):
        request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder())


@pytest.mark.parametrize("prompt", [[4, 9, 2], [[9]], [[1], [2, 9]], [[1], [2], [9]], [[1, 2], [3], [5, 9]]])
def test_a_token_id_past_the_vocabulary_is_refused_in_vllm_s_words_in_any_prompt_of_a_batch(prompt: list[Any]) -> None:
    """9 is past 8, the largest id the engine takes; 8 itself is no reason to refuse."""
    assert _refusal({"prompt": prompt}, max_token_id=8) == "Token id 9 is out of vocabulary"
    assert request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder(), max_token_id=9)
    assert request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder())  # None: not checked


@pytest.mark.parametrize(
    ("body", "ids"),
    [({"prompt": [9, 1, 2], "truncate_prompt_tokens": 2}, [1, 2]),
     ({"prompt": [1, 2, 9], "truncate_prompt_tokens": 2, "truncation_side": "right"}, [1, 2]),
     ({"prompt": [[9, 3], [9, 4]], "truncate_prompt_tokens": 1}, [3])],
)  # fmt: skip
def test_an_id_past_the_vocabulary_that_truncation_cuts_off_is_served(body: dict[str, Any], ids: list[int]) -> None:
    """vLLM checks the ids it keeps after ``truncate_prompt_tokens`` (its input processor validates the rendered
    prompt); the proxy refused these before truncating them."""
    assert request_tokens(body, chat=False, encoder=ByteEncoder(), max_token_id=8) == ids
    assert _refusal({**body, "truncate_prompt_tokens": 3}, max_token_id=8) == "Token id 9 is out of vocabulary"


def test_the_refusal_names_the_prompt_s_largest_id() -> None:
    assert _refusal({"prompt": [3, 12, 10, 1]}, max_token_id=8) == "Token id 12 is out of vocabulary"


@pytest.mark.parametrize("max_token_id", [None, 8])
@pytest.mark.parametrize(
    ("prompt", "ids"),
    [([1, True], [1, 1]), ([False, 2, 3], [0, 2, 3]), ([[4, 5, True]], [4, 5, 1]), ([1.0, 2.0], [1, 2]),
     ([3, "4", " 5 ", "6.00"], [3, 4, 5, 6]), ([[7.0], [2]], [7])],
)  # fmt: skip
def test_token_ids_route_as_vllm_reads_them(prompt: list[Any], ids: list[int], max_token_id: int | None) -> None:
    """vLLM's request model (pydantic, lax) reads a list[int] prompt's true as 1, 2.0 as 2 and "4" as 4, and serves
    it; the proxy refused such a prompt 400."""
    tokens = request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder(), max_token_id=max_token_id)
    assert tokens == ids and all(type(token) is int for token in tokens)  # 2.0 == 2 too, but no int for the router


@pytest.mark.parametrize("prompt", [[1.0, 9.0], [True, "9"], [[2], [3.0, "9"]]])
def test_a_token_id_vllm_reads_past_the_vocabulary_is_refused_in_its_words(prompt: list[Any]) -> None:
    assert _refusal({"prompt": prompt}, max_token_id=8) == "Token id 9 is out of vocabulary"


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [(["1", 2], [1, 2]), (["7", 2.0, True], [7, 2, 1]), (["1", "2"], list(b"1"))],
)
def test_a_list_that_starts_with_a_text_is_a_batch_only_as_vllm_reads_it(prompt: list[Any], tokens: list[int]) -> None:
    """pydantic reads ``["1", 2]`` as the ids [1, 2] (its smart union: no member takes the list strictly, and
    ``list[int]`` does laxly); a list of texts is a batch, routed on its first. The proxy routed the first two on
    the text "1" and "7"."""
    assert request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder()) == tokens


@pytest.mark.parametrize("prompt", [["a", 2], ["1e2", 2, 3, 4], ["a", None], [[1, 2], 3], [[1], {"x": 1}]])
def test_a_batch_holding_an_item_that_is_no_text_nor_list_is_refused_before_routing(prompt: list[Any]) -> None:
    """No member of vLLM's union takes it (``list[str]`` no int, ``list[int]`` no "a" or "1e2", ``list[list[int]]``
    no int): vLLM refuses it. Was: routed on its first prompt, for the engine to refuse, a decision made for
    nothing (and the sidecar's pick mode picked a backend for it)."""
    with pytest.raises(BadRequest, match="holds strings or lists of token ids, nothing else"):
        request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder())
    with pytest.raises(ServeBadRequest, match="holds strings or lists of token ids, nothing else"):
        openai_prompt("/v1/completions", json.dumps({"prompt": prompt}).encode())


@pytest.mark.parametrize("prompt", [[1, 1.5], [[4, None]], [2, -1], [1, None], [1, "1e2"], [[2, "x"]]])
def test_ids_of_another_kind_go_on_for_the_router_to_refuse_naming_the_id(prompt: list[Any]) -> None:
    tokens = request_tokens({"prompt": prompt}, chat=False, encoder=ByteEncoder())
    assert tokens == (prompt[0] if isinstance(prompt[0], list) else prompt)
    with pytest.raises(InvalidPromptError, match="position 1"):
        Router().route(tokens, ["a", "b"])


@pytest.mark.parametrize("body", [{"prompt_embeds": "UEsDBA=="}, {"prompt": None, "prompt_embeds": ["UEsDBA=="]},
                                  {"prompt": "", "prompt_embeds": "UEsDBA=="}])  # fmt: skip
def test_prompt_embeds_without_a_prompt_route_on_no_token_ids(body: dict[str, Any]) -> None:
    """vLLM run with --enable-prompt-embeds serves a completion of embeddings alone (base64 tensors): nothing to
    match in the index, but no reason to refuse it either (vLLM's own check wants a prompt or embeddings)."""
    assert request_tokens(body, chat=False, encoder=ByteEncoder(), max_token_id=8) == []


@pytest.mark.parametrize("prompt", [5, True, {"text": "a"}, [], [[]], [[], [1]]])
def test_a_prompt_that_is_no_text_nor_token_ids_is_refused(prompt: object) -> None:
    assert _refusal({"prompt": prompt}).startswith("'prompt' must be a string, a non-empty list of token ids")


@pytest.mark.parametrize("body", [None, [{"prompt": "a"}], "a", 5])
@pytest.mark.parametrize("chat", [False, True])
def test_a_body_that_is_no_json_object_is_refused(body: object, chat: bool) -> None:
    assert "must be a JSON object" in _refusal(body, chat=chat)


@pytest.mark.parametrize(
    "messages", [None, [], "hi", 5, {"role": "user", "content": "hi"}, ["hi"], [{"role": "user"}, None]]
)
def test_chat_messages_that_are_no_non_empty_list_of_objects_are_refused(messages: object) -> None:
    body = {"prompt": "text", "messages": messages}  # a prompt does not stand in for the messages
    assert _refusal(body, chat=True).startswith("'messages' must be a non-empty list")


def test_chat_messages_are_encoded_with_the_encoder_s_chat_rendering() -> None:
    messages = tool_call_conversation()
    body = {"messages": messages, "prompt": "ignored"}
    assert request_tokens(body, chat=True, encoder=ByteEncoder()) == ByteEncoder().encode(serialise_chat(messages))


@pytest.mark.parametrize("prompt", [[[9]], [[1], [9]]])
def test_the_async_form_refuses_ids_past_the_vocabulary(prompt: list[Any]) -> None:
    body = {"prompt": prompt}
    with pytest.raises(BadRequest, match="Token id 9 is out of vocabulary"):
        asyncio.run(request_tokens_async(body, chat=False, encoder=ByteEncoder(), max_token_id=8))
    assert asyncio.run(request_tokens_async(body, chat=False, encoder=ByteEncoder(), max_token_id=9))


@pytest.mark.parametrize("text", [LONG + "y", "short"])
def test_the_async_form_refuses_a_mixed_batch_inline_and_on_a_thread(text: str) -> None:
    with pytest.raises(BadRequest, match="holds strings or lists of token ids, nothing else"):
        asyncio.run(request_tokens_async({"prompt": [text, [9]]}, chat=False, encoder=ByteEncoder()))


# The encoders.


def test_the_byte_encoder_routes_text_on_its_utf8_bytes_a_lone_surrogate_too() -> None:
    """A body decoded by Python's json (Ray Serve, LiteLLM) can hold a lone surrogate (a ``\\ud800`` escape): it routes
    on the bytes of its code point, rather than failing the request."""
    encoder = ByteEncoder()
    assert encoder.encode("aé") == [*"aé".encode()]
    assert encoder.encode("a\ud800b") == [*b"a", 0xED, 0xA0, 0x80, *b"b"]
    assert encoder.encode("\ud800") != encoder.encode("\udfff")


def test_the_tokenizer_encoder_encodes_as_its_tokenizer_and_chats_as_serialised(model_dir: Path) -> None:
    tokenizer = PromptTokenizer.from_file(model_dir / "tokenizer.json")
    encoder = TokenizerEncoder(tokenizer)
    text = "You are a helpful assistant. SELECT name FROM orders;"
    assert encoder.encode(text) == tokenizer.encode(text) != []
    messages = tool_call_conversation()
    assert encoder.encode_chat(messages) == tokenizer.encode(serialise_chat(messages))
    assert request_tokens({"prompt": text}, chat=False, encoder=encoder) == tokenizer.encode(text)


class _EncodeOnly:
    def encode(self, text: str) -> list[int]:
        return []


class _ChatOnly:
    def encode_chat(self, messages: Any) -> list[int]:
        return []


class _NotCallable:
    encode = "encode"
    encode_chat = "encode_chat"


@pytest.mark.parametrize("encoder", [_EncodeOnly(), _ChatOnly(), _NotCallable(), "encoder"])
def test_an_encoder_without_both_encode_methods_is_refused_naming_its_type(encoder: object) -> None:
    with pytest.raises(InvalidTypeError, match=f"encode\\(\\) and encode_chat\\(\\), not {type(encoder).__name__}$"):
        check_encoder(encoder)


def test_an_encoder_with_both_is_taken(model_dir: Path) -> None:
    check_encoder(ByteEncoder())
    check_encoder(TokenizerEncoder(PromptTokenizer.from_file(model_dir / "tokenizer.json")))


def test_the_encoders_name_the_type_they_refuse() -> None:
    with pytest.raises(InvalidTypeError, match="must be a str, not bytes$"):
        ByteEncoder().encode(b"text")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="must be a PromptTokenizer, not str$"):
        TokenizerEncoder("tokenizer.json")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        ({"truncate_prompt_tokens": 3}, b"def"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "left"}, b"def"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "right"}, b"abc"),
        ({"truncate_prompt_tokens": 3, "truncation_side": None}, b"def"),
        ({"truncate_prompt_tokens": 6}, b"abcdef"),
        ({"truncate_prompt_tokens": 60}, b"abcdef"),
        # as vLLM's pydantic models read an int (lax)
        ({"truncate_prompt_tokens": True}, b"f"),
        ({"truncate_prompt_tokens": "3"}, b"def"),
        ({"truncate_prompt_tokens": 3.0}, b"def"),
        ({"truncate_prompt_tokens": " 2.00\n"}, b"ef"),
        ({"truncate_prompt_tokens": "\u00a02\u3000"}, b"ef"),
        ({"truncate_prompt_tokens": "+3"}, b"def"),
        ({"truncate_prompt_tokens": "0_3"}, b"def"),
        # left for the engine to answer: the model's context (-1), unknown here; 0; null; values vLLM refuses
        ({"truncate_prompt_tokens": -1}, b"abcdef"),
        ({"truncate_prompt_tokens": "-1"}, b"abcdef"),
        ({"truncate_prompt_tokens": None}, b"abcdef"),
        ({"truncate_prompt_tokens": 0}, b"abcdef"),
        ({"truncate_prompt_tokens": 0, "truncation_side": "right"}, b"abcdef"),
        ({"truncate_prompt_tokens": False}, b"abcdef"),
        ({"truncate_prompt_tokens": 2.5}, b"abcdef"),
        ({"truncate_prompt_tokens": "2.5"}, b"abcdef"),
        ({"truncate_prompt_tokens": "1e2"}, b"abcdef"),
        ({"truncate_prompt_tokens": "2."}, b"abcdef"),
        ({"truncate_prompt_tokens": "1__0"}, b"abcdef"),
        ({"truncate_prompt_tokens": "٣"}, b"abcdef"),
        ({"truncate_prompt_tokens": [3]}, b"abcdef"),
        ({"truncate_prompt_tokens": 3, "truncation_side": "middle"}, b"abcdef"),
    ],
)
def test_a_prompt_is_truncated_as_vllm_truncates_it(options: dict[str, object], kept: bytes) -> None:
    """vLLM 0.33 keeps the last N tokens of a prompt given ``truncate_prompt_tokens`` N (the first N with
    ``truncation_side`` "right"): the engine caches those, so the router routes on them, text or token ids."""
    encoder = ByteEncoder()
    assert request_tokens({"prompt": "abcdef", **options}, chat=False, encoder=encoder) == list(kept)
    assert request_tokens({"prompt": list(b"abcdef"), **options}, chat=False, encoder=encoder) == list(kept)


def test_an_int_string_is_read_up_to_the_digits_python_and_pydantic_read() -> None:
    assert request_int("9" * 4300) == int("9" * 4300)
    assert request_int("9" * 4301) is None  # int() would raise: pydantic refuses it too
    assert request_tokens({"prompt": "abc", "truncate_prompt_tokens": "9" * 4301}, chat=False, encoder=ByteEncoder())


@pytest.mark.parametrize(("side", "kept"), [("left", slice(-4, None)), ("right", slice(0, 4))])
def test_a_chat_is_truncated_after_its_template(side: str, kept: slice) -> None:
    encoder = ByteEncoder()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "abcdef"}]}
    whole = request_tokens(body, chat=True, encoder=encoder)
    cut = request_tokens({**body, "truncate_prompt_tokens": 4, "truncation_side": side}, chat=True, encoder=encoder)
    assert cut == whole[kept] and len(whole) > 4
