"""The token ids an OpenAI request routes on: the client's own token ids, else its text through an encoder."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Protocol, runtime_checkable

import msgspec

from prefixroute.adapters.serve.contract import (
    is_batch,
    mixed_batch,
    request_flag,
    request_ints,
    truncated,
)
from prefixroute.adapters.tokenize import PromptTokenizer, serialise_chat
from prefixroute.errors import InvalidTypeError

__all__ = ["BadRequest", "ByteEncoder", "PromptEncoding", "TokenizerEncoder", "request_tokens", "request_tokens_async"]

INLINE_TEXT = 64 * 2**10
"""A request with more text than this (characters of its prompt or messages; bytes of a raw body) is encoded on a
worker thread, off the event loop: 64 Ki characters, ~16K tokens, take 10-20 ms to tokenize, in which no other
request on the loop moves. A shorter one is encoded inline, where a thread hop would cost more than it saves."""


class BadRequest(Exception):
    """A request the proxy answers with an OpenAI-style error: ``status`` and a message saying what to fix."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@runtime_checkable
class PromptEncoding(Protocol):
    """What turns a request's text into the token ids it routes on (e.g. the model's tokenizer and template)."""

    def encode(self, text: str) -> list[int]:
        """The token ids of a completion prompt.

        An encoder whose ``encode`` also takes ``add_special_tokens=False`` gets it for a completion that sets
        vLLM's field of that name false, as :class:`~prefixroute.adapters.serve.PromptEncoder` does.
        """

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The token ids of a chat conversation, as rendered for the model.

        An encoder may also have ``encode_chat_request(body) -> list[int]``, which the proxy then calls instead with
        the whole chat completion request (its ``tools`` and template options too), as
        :class:`~prefixroute.adapters.serve.PromptEncoder` does.
        """


def check_encoder(encoder: object) -> None:
    """Raise InvalidTypeError unless ``encoder`` has callable ``encode()`` and ``encode_chat()`` (a PromptEncoding)."""
    if not (callable(getattr(encoder, "encode", None)) and callable(getattr(encoder, "encode_chat", None))):
        raise InvalidTypeError(f"encoder must have encode() and encode_chat(), not {type(encoder).__name__}")


class TokenizerEncoder:
    """Encode with the model's local ``tokenizer.json`` (chat messages serialised by :func:`serialise_chat`).

    Raises:
        TypeError: ``tokenizer`` is not a :class:`~prefixroute.adapters.tokenize.PromptTokenizer`.
    """

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        if not isinstance(tokenizer, PromptTokenizer):
            raise InvalidTypeError(f"tokenizer must be a PromptTokenizer, not {type(tokenizer).__name__}")
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """O(len(text)); the Rust tokenizer releases the GIL."""
        return self._tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """O(total text)."""
        return self._tokenizer.encode(serialise_chat(messages))


class ByteEncoder:
    """Route text on its UTF-8 bytes, one "token" a byte: for a proxy without the model's tokenizer.

    Prompts that share a text prefix still share a backend, but the router's token counts (matched and pending
    prefill tokens) are bytes, about four per real token, and KV events (which carry real token ids) cannot
    confirm these predictions: pass ``--tokenizer`` for those.
    """

    def encode(self, text: str) -> list[int]:
        """O(len(text)).

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise InvalidTypeError(f"text must be a str, not {type(text).__name__}")
        return list(text.encode("utf-8", "surrogatepass"))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """O(total text)."""
        return self.encode(serialise_chat(messages))


def chat_tokens(encoder: PromptEncoding, body: dict[str, Any]) -> list[int]:
    """The token ids of a chat completion request: the encoder's ``encode_chat_request(body)`` when it has one (the
    whole request, its tools and template options with its messages, as
    :meth:`PromptEncoder.encode_chat_request <prefixroute.adapters.serve.PromptEncoder.encode_chat_request>`
    renders it), else its ``encode_chat(messages)``. O(the request)."""
    whole = getattr(encoder, "encode_chat_request", None)
    return whole(body) if callable(whole) else encoder.encode_chat(body["messages"])


def text_tokens(encoder: PromptEncoding, text: str, body: Mapping[str, Any]) -> list[int]:
    """The token ids of a completion's text prompt: without the tokenizer's special tokens when the request sets
    vLLM's ``add_special_tokens`` false (a prompt rendered by the client holds them already) and the encoder's
    ``encode()`` takes that keyword (:class:`~prefixroute.adapters.serve.PromptEncoder`'s does); else ``encode(text)``.
    O(len(text)).

    Raises:
        InvalidPromptError: ``add_special_tokens`` is not a boolean as vLLM reads one.
    """
    without = "add_special_tokens" in body and not request_flag(body, "add_special_tokens", default=True)
    if without and _takes_keyword(encoder.encode, "add_special_tokens"):
        return encoder.encode(text, add_special_tokens=False)  # type: ignore[call-arg]
    return encoder.encode(text)


def _takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether ``function`` has a parameter ``name`` (False when Python cannot say, as for some builtins)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def request_tokens(body: object, *, chat: bool, encoder: PromptEncoding, max_token_id: int | None = None) -> list[int]:
    """The token ids ``body`` (a decoded OpenAI request) routes on. O(prompt); O(batch) for a batch of token ids.

    Completions: ``prompt`` as token ids is used as sent; as text it is encoded; a batch routes on its first
    prompt; ``prompt_embeds`` without a prompt (vLLM's ``--enable-prompt-embeds``) has no token ids, ``[]``, and so
    routes on load alone. Chat: the request is encoded by :func:`chat_tokens`. Then :func:`truncated`, as the
    request asks. ``max_token_id``: the largest id the engine takes (:attr:`PromptEncoder.max_token_id
    <prefixroute.adapters.serve.PromptEncoder.max_token_id>`), to refuse a prompt of token ids past it, every prompt
    of a batch, as vLLM does; None: not checked.

    Raises:
        BadRequest: the body is not an object, or has no usable ``prompt`` / ``messages`` (a ``prompt`` absent, null
            or ``""`` without ``prompt_embeds``, in vLLM's words), or a prompt's token id is past ``max_token_id``
            (vLLM's message: ``Token id N is out of vocabulary``).
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return truncated(_request_tokens(body, chat=chat, encoder=encoder, max_token_id=max_token_id), body)


def _request_tokens(
    body: dict[str, Any], *, chat: bool, encoder: PromptEncoding, max_token_id: int | None
) -> list[int]:
    """:func:`request_tokens` before truncation."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest('\'messages\' must be a non-empty list of {"role", "content"} objects')
        return chat_tokens(encoder, body)
    prompt = body.get("prompt")
    if prompt is None or prompt == "":  # vLLM's check and words: no prompt to route on, nor for the engine
        embeds = body.get("prompt_embeds")
        if embeds is None or embeds == []:
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.")
        return []  # embeddings alone (vLLM's --enable-prompt-embeds): no token ids to match, routed on load
    if isinstance(prompt, list) and prompt and is_batch(prompt):
        if mixed_batch(prompt):  # vLLM refuses it: route nothing
            raise BadRequest("'prompt' as a batch holds strings or lists of token ids, nothing else")
        if max_token_id is not None:  # the engine refuses the whole batch for one prompt's id
            for other in prompt[1:]:
                if isinstance(other, list):
                    _converted(truncated(other, body), max_token_id)  # not a list of ints: the engine's to answer
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, str):
        return text_tokens(encoder, prompt, body)
    if isinstance(prompt, list) and prompt:
        # vLLM checks the ids it keeps: an id past the vocabulary that truncate_prompt_tokens cuts off is served.
        return _token_ids(truncated(prompt, body), max_token_id)
    raise BadRequest("'prompt' must be a string, a non-empty list of token ids, or a batch of those")


async def request_tokens_async(
    body: object, *, chat: bool, encoder: PromptEncoding, max_token_id: int | None = None
) -> list[int]:
    """:func:`request_tokens` for a caller on an event loop: on a worker thread (``asyncio.to_thread``) when the
    body holds over :data:`INLINE_TEXT` characters of text, else inline. The encoder must then be thread-safe, as
    :class:`TokenizerEncoder` and :class:`ByteEncoder` are. O(prompt); O(messages) on the loop.

    Raises:
        BadRequest: as :func:`request_tokens`.
    """
    if _text_length(body, chat) > INLINE_TEXT:
        return await asyncio.to_thread(request_tokens, body, chat=chat, encoder=encoder, max_token_id=max_token_id)
    return request_tokens(body, chat=chat, encoder=encoder, max_token_id=max_token_id)


def _text_length(body: object, chat: bool) -> int:
    """About how many characters of text ``body`` gives the encoder (each message counted 16 more, its markers; a
    chat's tools, documents and template kwargs too), without reading what :func:`request_tokens` refuses.
    O(messages); O(the messages' values) for a chat."""
    if not isinstance(body, dict):
        return 0
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        rendered = [*messages, *(body.get(name) for name in ("tools", "documents", "chat_template_kwargs"))]
        return 16 * len(messages) + _strings_length(rendered)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return len(prompt) if isinstance(prompt, str) else 0


def _strings_length(value: object) -> int:
    """The characters of every string in ``value`` (messages: their role and content, their content parts' text, and
    what else a chat template renders, a tool call's arguments, a reasoning text), counted until past
    :data:`INLINE_TEXT`.
    Iterative, each dict and list once: a body nested deep does not recurse, and one a Python caller built with a
    cycle or with one list shared many times over ends. O(its values)."""
    total = 0
    stack: list[object] = [value]
    seen: set[int] = set()
    while stack and total <= INLINE_TEXT:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)
    return total


def _token_ids(prompt: list[Any], max_token_id: int | None) -> list[Any]:
    """``prompt`` as the token ids vLLM reads from it (:func:`_converted`), refusing an id past ``max_token_id``; a
    list vLLM does not read as ids goes on as it is, and the router refuses it naming the bad id. O(n), in C for a
    list of ints."""
    ids = _converted(prompt, max_token_id)
    return prompt if ids is None else ids


def _converted(prompt: list[Any], max_token_id: int | None) -> list[int] | None:
    """``prompt`` as a list of ints, as vLLM's request model (pydantic, lax) reads a ``list[int]`` prompt: ints, and
    also ``true``/``false`` (1 and 0), floats without a fraction (``2.0``) and strings of an int (``"2"``), each read
    by :func:`~prefixroute.adapters.serve.contract.request_ints`; None when an item is none of these (``1.5``, null).
    O(n): msgspec converts a list of plain ints and checks the bound as it goes, in C (a third of the cost of a
    ``max()`` after, measured on 2K ids); only a list holding another kind of item is read item by item.

    Raises:
        BadRequest: an id is past ``max_token_id``, in vLLM's words (naming the prompt's largest id) and with its
            status (400).
    """
    try:
        return msgspec.convert(prompt, list[int] if max_token_id is None else _bounded_ids(max_token_id))
    except msgspec.ValidationError:
        pass
    try:
        ids = msgspec.convert(prompt, list[int])  # plain ints: only the bound failed
    except msgspec.ValidationError:
        lax = request_ints(prompt)
        if lax is None:
            return None
        ids = lax
    if max_token_id is not None and max(ids) > max_token_id:
        raise BadRequest(f"Token id {max(ids)} is out of vocabulary")
    return ids


@functools.lru_cache(maxsize=16)
def _bounded_ids(max_token_id: int) -> Any:
    """The type of a list of token ids none of which is past ``max_token_id``."""
    return list[Annotated[int, msgspec.Meta(le=max_token_id)]]
