"""The sidecar's HTTP contract: the JSON bodies it reads, checked once, and the bad-input answer it gives.

``POST /route`` takes exactly one of ``prompt_token_ids`` (a list of ints in [0, 2**32)), ``prompt`` (a str) or
``messages`` (OpenAI chat messages: a str ``role``; a ``content`` that is a str, a list of content parts or null),
and optionally ``model`` (a str: the hash namespace; ``""`` is none, as vLLM reads it), ``lease`` (seconds, > 0;
the sidecar cuts it to its own lease), ``backends`` (a non-empty list of at most 4096 str) and vLLM's tokenizing
fields (``add_special_tokens``, ``truncate_prompt_tokens``, ``truncation_side``). ``POST /first_token``
takes ``{"id": str}``, ``POST /finish`` ``{"id": str}`` and optionally ``refused`` (a bool: the engine answered 4xx,
so it cached nothing).
Unknown fields are ignored, so a client may send more than the contract names. Any violation becomes
:class:`BadRequest`: an HTTP status (4xx) and one message that says what to fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

import msgspec

from prefixroute._numbers import as_int
from prefixroute.errors import InvalidPromptError, InvalidTypeError, PrefixRouteError

__all__ = [
    "BadRequest",
    "CHAT_OPTIONS",
    "base_model_names",
    "check_messages",
    "FinishBody",
    "LifecycleBody",
    "MAX_REQUEST_BACKENDS",
    "Prompt",
    "RouteBody",
    "UNSUPPORTED_MEDIA_TYPE",
    "UNDECODED",
    "decode",
    "decoded_as_vllm_does",
    "is_json_media_type",
    "is_batch",
    "mixed_batch",
    "is_refusal",
    "json_error",
    "json_type",
    "openai_prompt",
    "out_of_vocabulary",
    "request_flag",
    "request_int",
    "request_ints",
    "route_prompt",
    "salted",
    "truncated",
    "without_bom",
]


MAX_REQUEST_BACKENDS = 4096
"""The most backends one ``/route`` body may list: routing is O(backends) on the event loop, so a body listing a
million (32 MiB allows it) held every other request up for seconds; the sidecar keeps no more per-request backends
than this either (it forgets the least recently routed past it)."""


class BadRequest(PrefixRouteError):
    """Input the sidecar refuses: ``status`` (4xx) and a message naming the field and what to send instead; or 500
    and what failed, when the routing policy did. A :class:`~prefixroute.PrefixRouteError`, as every error
    prefixroute raises itself."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RouteBody(msgspec.Struct):
    """The body of ``POST /route``."""

    prompt_token_ids: list[int] | None = None  # the range is checked by the router, in C
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    model: str | None = None
    lease: Annotated[float, msgspec.Meta(gt=0)] | None = None
    backends: list[str] | None = None
    # With messages, what else of the chat request the engine renders: as in vLLM's chat completion request, where
    # null is the default of all but the two flags.
    tools: list[dict[str, Any]] | None | msgspec.UnsetType = msgspec.UNSET
    documents: list[dict[str, Any]] | None | msgspec.UnsetType = msgspec.UNSET
    add_generation_prompt: bool | msgspec.UnsetType = msgspec.UNSET
    continue_final_message: bool | msgspec.UnsetType = msgspec.UNSET
    chat_template_kwargs: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_effort: str | None | msgspec.UnsetType = msgspec.UNSET
    # With any prompt, how vLLM tokenizes and cuts it (a completion's and a chat's fields of those names).
    add_special_tokens: bool | msgspec.UnsetType = msgspec.UNSET
    truncate_prompt_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    truncation_side: Literal["left", "right"] | None | msgspec.UnsetType = msgspec.UNSET


_PROMPT_OPTIONS = ("add_special_tokens", "truncate_prompt_tokens", "truncation_side")
"""What of a completion request, besides its prompt, vLLM's tokenizing follows."""
CHAT_OPTIONS = (
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "reasoning_effort",
)
"""What of a chat completion request, besides its messages, vLLM's chat template renders."""


class LifecycleBody(msgspec.Struct):
    """The body of ``POST /first_token``."""

    id: str


class FinishBody(LifecycleBody):
    """The body of ``POST /finish``: ``refused`` when the engine refused the request (a 4xx answer)."""

    refused: bool = False


def is_refusal(status: int) -> bool:
    """Whether an HTTP status from the engine says it refused the request, computing nothing: a 4xx (vLLM's 400 for
    a prompt past its context), except a timeout (408: LiteLLM's for an engine slow to answer) and nginx's 499, which
    it logs for a client that left: the engine may have computed part of the prompt. O(1).

    >>> is_refusal(400), is_refusal(429), is_refusal(408), is_refusal(499), is_refusal(500), is_refusal(200)
    (True, True, False, False, False, False)

    Raises:
        TypeError: ``status`` is not an int (a str from a header: convert it first).
    """
    code = as_int(status)
    if code is None:
        raise InvalidTypeError(f"an HTTP status is an int such as 400, not {type(status).__name__}")
    return 400 <= code < 500 and code not in (408, 499)


UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"
"""vLLM's message for a completion request whose body is not labelled JSON (its answer: 400)."""


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a request's ``Content-Type`` labels its body JSON as vLLM's OpenAI server reads it (the
    ``validate_json_request`` dependency of its completion routes): lowercased and cut at the first ``;``, exactly
    ``application/json``. No header at all is not JSON. O(len(content_type)).

    >>> [is_json_media_type(t) for t in ("application/json; charset=utf-8", "Application/JSON", "text/plain", None)]
    [True, True, False, False]
    """
    return (content_type or "").lower().split(";", 1)[0] == "application/json"


Prompt = list[int] | str | list[dict[str, Any]] | dict[str, Any]
"""What a request asks to route: token ids, a text prompt, chat messages (to render with a chat template), or a
request with its options: a chat (its messages rendered with its tools and template options) or a prompt (text or
token ids) with vLLM's tokenizing fields (:data:`_PROMPT_OPTIONS`)."""


def without_bom(body: bytes) -> bytes:
    """``body`` without a leading UTF-8 byte-order mark: RFC 8259 lets a JSON parser ignore one, and vLLM's does
    (Python's ``json`` reads bytes that start with one), so a client that works against vLLM works through prefixroute
    too. O(1) without one.

    Raises:
        InvalidTypeError: ``body`` is not bytes (a ``bytearray`` or ``memoryview`` of bytes is read as bytes).
    """
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"a request body must be bytes, not {type(body).__name__}")
    return body[3:] if body[:3] == b"\xef\xbb\xbf" else body


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode and check a JSON body as ``kind``. O(len(body)).

    Raises:
        BadRequest: 400 for malformed JSON (nested too deep, or holding a lone surrogate escape, included), a
            missing field or a field of the wrong type or range (the message names the field, e.g.
            ``$.prompt_token_ids[3]``).
    """
    try:
        return msgspec.json.decode(without_bom(body), type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(400, f"invalid request body: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(400, json_error(body, exc)) from None


def route_prompt(body: RouteBody) -> Prompt:
    """The one prompt of a ``/route`` body: with ``messages`` and any of :data:`CHAT_OPTIONS` not null, the chat
    request they make (a dict); with any prompt and vLLM's ``add_special_tokens``, ``truncate_prompt_tokens`` or
    ``truncation_side``, the request those make (``{"prompt", ...}`` or the chat's), tokenized and cut as vLLM does,
    as the pick mode reads them. A null option is absent, as vLLM's default.

    Raises:
        BadRequest: 400 unless exactly one of ``prompt_token_ids``, ``prompt`` and ``messages`` is given and
            non-empty, when ``backends`` is given empty or longer than :data:`MAX_REQUEST_BACKENDS`, when a message
            breaks :func:`check_messages`, or a chat option (not null) comes without ``messages``.
    """
    given = [
        name
        for name, value in (
            ("prompt_token_ids", body.prompt_token_ids),
            ("prompt", body.prompt),
            ("messages", body.messages),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise BadRequest(
            400,
            "send exactly one of 'prompt_token_ids' (token ids), 'prompt' (text) or 'messages' (chat), "
            f"not {' and '.join(given) if given else 'none of them'}",
        )
    if body.backends is not None and not body.backends:
        raise BadRequest(400, "'backends' is empty: list at least one backend URL, or omit it to use the sidecar's")
    if body.backends is not None and len(body.backends) > MAX_REQUEST_BACKENDS:
        raise BadRequest(
            400, f"'backends' lists {len(body.backends)} backends: list at most {MAX_REQUEST_BACKENDS} in one request"
        )
    prompt: Prompt | None = body.prompt_token_ids
    if prompt is None:
        prompt = body.prompt if body.prompt is not None else body.messages
    assert prompt is not None
    if not prompt:
        raise BadRequest(400, f"'{given[0]}' is empty: send the prompt to route")
    # null is an option's default (vLLM's): as absent, with a prompt too
    options = {
        name: value
        for name in CHAT_OPTIONS
        if (value := getattr(body, name)) is not msgspec.UNSET and value is not None
    }
    tokenizing = {
        name: value
        for name in _PROMPT_OPTIONS
        if (value := getattr(body, name)) is not msgspec.UNSET and value is not None
    }
    if body.messages is None:
        if options:
            raise BadRequest(400, f"{', '.join(map(repr, options))} go with 'messages' only: send the chat's messages")
        return {"prompt": prompt, **tokenizing} if tokenizing else prompt
    check_messages(body.messages)
    options.update(tokenizing)
    return {"messages": body.messages, **options} if options else prompt


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Check chat messages as vLLM takes them: a string ``role``, and a ``content`` that is a string, a list of
    content parts or null / absent (an assistant's tool calls). A part is a string (vLLM's simple text part) or an
    object with a str ``type`` (``text`` when absent) whose ``text``, for a text part, is a string or null / absent
    (a part vLLM leaves out). O(parts).

    Raises:
        BadRequest: 400 naming the first wrong field, e.g. ``$.messages[2].content``.
    """
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise BadRequest(400, f"$.messages[{i}].role must be a string, not {json_type(message.get('role'))}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadRequest(
                400,
                f"$.messages[{i}].content must be a string, a list of content parts or null, not {json_type(content)}",
            )
        for j, part in enumerate(content):
            if isinstance(part, str):
                continue
            if not isinstance(part, dict):
                raise BadRequest(
                    400,
                    f'$.messages[{i}].content[{j}] must be a content part like {{"type": "text", "text": "..."}} or '
                    f"a string, not {json_type(part)}",
                )
            kind = part.get("type", "text")  # a part without a type is read as text
            if not isinstance(kind, str):
                raise BadRequest(
                    400,
                    f'$.messages[{i}].content[{j}].type must be a string such as "text", not '
                    f"{'null' if kind is None else json_type(kind)}",
                )
            text = part.get("text")
            if kind == "text" and text is not None and not isinstance(text, str):
                raise BadRequest(400, f"$.messages[{i}].content[{j}].text must be a string, not {json_type(text)}")


def json_type(value: object) -> str:
    """What ``value`` is, in JSON's words (for error messages). O(1).

    >>> json_type(None), json_type(True), json_type(2.5), json_type("x"), json_type([]), json_type({})
    ('null (or missing)', 'a boolean', 'a number', 'a string', 'an array', 'an object')
    """
    if value is None:
        return "null (or missing)"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def salted(namespace: str | None, cache_salt: object) -> str | None:
    """The router namespace of a request in ``namespace`` with vLLM's ``cache_salt``: ``namespace`` itself without a
    salt (none, or one vLLM refuses: not a non-empty string, which the engine answers), else ``namespace`` (``""``
    for None), a NUL, ``cache_salt:`` and the salt. vLLM hashes the salt into a request's first block, so its blocks
    are shared only with requests of the same salt and model; no model name holds a NUL. O(len(cache_salt)).

    >>> salted(None, "tenant-a"), salted("sql", "tenant-a"), salted("sql", None), salted(None, "")
    ('\\x00cache_salt:tenant-a', 'sql\\x00cache_salt:tenant-a', 'sql', None)
    """
    if not isinstance(cache_salt, str) or not cache_salt:
        return namespace
    return f"{namespace or ''}\x00cache_salt:{cache_salt}"


def openai_prompt(path: str, body: bytes, *, max_token_id: int | None = None) -> tuple[Prompt, str | None, object]:
    """The prompt, model and ``cache_salt`` (None without one; see :func:`salted`) of an OpenAI ``/v1/completions``
    or ``/v1/chat/completions`` request body.

    A batch of prompts is routed by its first one (one that mixes texts and lists, or holds an item that is
    neither, is refused, as vLLM refuses it; with ``max_token_id``, so is one whose other prompts of token ids hold
    an id past it, as vLLM refuses the whole batch for one: the first prompt's ids are the caller's to check); a chat
    by the whole request (its ``tools`` and template options
    render with its messages, its ``truncate_prompt_tokens`` cuts them); a prompt with vLLM's ``add_special_tokens``,
    ``truncate_prompt_tokens`` or ``truncation_side`` as ``{"prompt", ...those}``. O(len(body)).

    Raises:
        BadRequest: 400 when the body is not such a request (no usable ``prompt`` or ``messages``, or a message
            that breaks :func:`check_messages`).
        InvalidTypeError: ``path`` is not a str, or ``body`` not bytes.
    """
    if not isinstance(path, str):
        raise InvalidTypeError(f"path must be the request's URL path (a str), not {type(path).__name__}")
    try:
        request = msgspec.json.decode(without_bom(body))
    except (msgspec.DecodeError, RecursionError) as exc:  # a client's own body: read as vLLM reads it, NaN and all
        request = decoded_as_vllm_does(body)
        if request is UNDECODED:
            raise BadRequest(400, json_error(body, exc)) from None
    if not isinstance(request, dict):
        raise BadRequest(400, "an OpenAI request body is a JSON object")
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(400, "'model' must be a string")
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest(400, "a chat completion needs 'messages', a non-empty list of message objects")
        check_messages(messages)
        return request, model, request.get("cache_salt")
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and is_batch(prompt):
        if mixed_batch(prompt):
            raise BadRequest(400, "a batch 'prompt' holds strings or lists of token ids, nothing else")
        if max_token_id is not None:
            for other in prompt[1:]:
                ids = request_ints(truncated(other, request)) if isinstance(other, list) else None
                if ids and max(ids) > max_token_id:  # as vLLM checks the ids it keeps
                    raise BadRequest(400, out_of_vocabulary(max(ids), max_token_id))
        prompt = prompt[0]  # a batch: its first prompt decides
    options = {name: request[name] for name in _PROMPT_OPTIONS if name in request}
    salt = request.get("cache_salt")
    if isinstance(prompt, str) and prompt:
        return ({"prompt": prompt, **options} if options else prompt), model, salt
    ids = request_ints(prompt) if isinstance(prompt, list) and prompt else None  # as vLLM reads them: "3" is 3
    if ids is not None and all(0 <= t < 2**32 for t in ids):
        return ({"prompt": ids, **options} if options else ids), model, salt
    raise BadRequest(400, "a completion needs 'prompt': a non-empty string or list of token ids in [0, 2**32)")


def truncated(tokens: list[int], body: Mapping[str, Any]) -> list[int]:
    """``tokens`` as vLLM 0.33 truncates a request's prompt: with ``truncate_prompt_tokens`` N (at least 1, read as
    vLLM reads an int: :func:`request_int`), the last N tokens
    (``truncation_side`` "left", vLLM's default for a generating model) or the first N ("right"). Anything else is
    left as it is, for the engine to answer: ``-1`` (the model's context, unknown here), 0, null, a value vLLM
    refuses. O(N).

    >>> truncated([1, 2, 3, 4], {"truncate_prompt_tokens": 2}), truncated([1, 2, 3, 4], {"truncate_prompt_tokens": 2,
    ... "truncation_side": "right"}), truncated([1, 2], {"truncate_prompt_tokens": 5})
    ([3, 4], [1, 2], [1, 2])
    """
    keep = request_int(body.get("truncate_prompt_tokens"))
    side = body.get("truncation_side", "left")
    if keep is None or keep < 1 or keep >= len(tokens) or side not in ("left", "right", None):
        return tokens
    return tokens[:keep] if side == "right" else tokens[-keep:]


UNDECODED = object()
"""What :func:`decoded_as_vllm_does` returns for a body that no JSON reader takes (a JSON ``null`` is None)."""


def decoded_as_vllm_does(raw: bytes) -> Any:
    """``raw`` as Python's ``json.loads`` reads it, as vLLM's server does (FastAPI calls it), where msgspec could
    not: the literals ``NaN``, ``Infinity`` and ``-Infinity`` (Python's ``json.dumps`` and aiohttp's ``json=`` write
    them for a float such as a ``logit_bias`` of ``-inf``), a body in UTF-16 or UTF-32. :data:`UNDECODED` where
    Python's json refuses it too or nests too deep, and where a string holds a lone surrogate (refused as before, in
    :func:`json_error`'s words). Only on msgspec's error path: O(len(raw)) in Python's C decoder."""
    try:
        body = json.loads(raw)
        msgspec.json.encode(body)  # UnicodeEncodeError for a lone surrogate
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError and UnicodeEncodeError are ValueErrors
        return UNDECODED
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def json_error(body: bytes, exc: msgspec.DecodeError | RecursionError) -> str:
    """What to tell a client whose body msgspec could not decode (the sidecar's and the proxy's 400s).

    Nested deeper than the decoder recurses (Python's limit: ~1,000 levels up to 3.11, ~10,000 from 3.12): says so.
    Otherwise, on this error path only, a body that holds a UTF-16 surrogate escape, that Python's own parser reads
    and whose strings then hold a lone surrogate (msgspec's message for it is "Input data was truncated"), gets a
    message saying so; any other body msgspec's own message.
    """
    if isinstance(exc, RecursionError):
        return (
            "the request body nests arrays or objects deeper than the JSON decoder recurses (thousands of levels): "
            "send a flatter body (no OpenAI request nests more than a few levels)"
        )
    if _SURROGATE_ESCAPE.search(body) is not None:
        try:
            msgspec.json.encode(json.loads(body, parse_constant=_no_constant))
        except UnicodeEncodeError:
            return (
                "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair) in a "
                "string: send text as valid Unicode (a character outside the BMP as UTF-8 or as an escaped pair "
                "like \\ud83d\\ude00)"
            )
        except Exception:  # noqa: BLE001, S110 - not JSON for Python either, or nested too deep: msgspec's message
            pass
    return f"the request body is not valid JSON: {exc}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def base_model_names(cards: object) -> frozenset[str]:
    """The base models among OpenAI ``/v1/models`` cards: those without a ``parent`` (vLLM lists a LoRA adapter
    with its base model as ``parent``). Anything that is not a card with a str ``id`` is skipped. O(cards)."""
    if not isinstance(cards, list):
        return frozenset()
    return frozenset(
        card["id"]
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("id"), str) and card.get("parent") is None
    )


def request_flag(body: Mapping[str, Any], name: str, *, default: bool) -> bool:
    """A request's boolean field, ``default`` when absent, read as vLLM's request models (pydantic, lax) read it:
    ``true``/``false``, ``0``/``1`` (also ``0.0``/``1.0``), or a string such as ``"yes"``, ``"off"``, ``"t"`` in any
    case. O(1).

    >>> [request_flag({"f": v}, "f", default=True) for v in (False, 0, "no", "OFF", 1.0, "t")]
    [False, False, False, False, True, True]
    >>> request_flag({}, "f", default=True)
    True

    Raises:
        InvalidPromptError: it is none of these (null included: vLLM's flags are not optional).
    """
    value = body.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _BOOLEAN_WORDS:
        return _BOOLEAN_WORDS[value.lower()]
    raise InvalidPromptError(f"'{name}' must be true or false, not {json_type(value)}")


def request_int(value: object) -> int | None:
    """A request's integer field as vLLM's request models (pydantic, lax) read it: an int, a bool (``true`` is 1), a
    float without a fraction (``2.0``), or a string of one (``"2"``, ``" 2.00 "``, ``"1_000"``); None for anything
    else, for the engine to answer. O(len(value)).

    >>> [request_int(v) for v in (3, True, 2.0, 1e2, " 7 ", "2.00", "1_000", 2.5, "2.5", "1e2", "abc", None)]
    [3, 1, 2, 100, 7, 2, 1000, None, None, None, None, None]
    """
    if isinstance(value, bool):
        return int(value)
    number = as_int(value)
    if number is not None:
        return number
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and len(value) <= _MAX_INT_TEXT and (match := _INT_TEXT.fullmatch(value)):
        return int(match[1])
    return None


def is_batch(prompt: list[Any]) -> bool:
    """Whether vLLM reads a completion's non-empty list ``prompt`` as a batch of prompts, not one prompt of token ids,
    as pydantic's smart union of vLLM's ``list[int] | list[list[int]] | str | list[str]`` reads it: a list of texts,
    or one that starts with a list, is a batch (or refused); one that starts with a text and holds something else is
    one prompt of ids when each item reads as an int (:func:`request_ints`: ``["1", 2]`` is ``[1, 2]``).
    O(len(prompt)).

    >>> is_batch(["a", "b"]), is_batch(["1", 2]), is_batch([[1], [2]]), is_batch([1, "2"]), is_batch(["a", 2])
    (True, False, True, False, True)
    """
    first = prompt[0]
    if isinstance(first, list):
        return True
    if not isinstance(first, str):
        return False
    return all(isinstance(item, str) for item in prompt) or request_ints(prompt) is None


def mixed_batch(batch: list[Any]) -> bool:
    """Whether a batch (:func:`is_batch`) is not all texts or all lists, which no member of vLLM's union takes
    (``list[str]`` takes no int and no list, ``list[int]`` no text that is no int, ``list[list[int]]`` no int and no
    text): vLLM refuses it. O(len(batch)).

    >>> mixed_batch(["a", "b"]), mixed_batch([[1], [2]]), mixed_batch(["a", 2]), mixed_batch([[1], 3])
    (False, False, True, True)
    >>> mixed_batch([[1], "a"]), mixed_batch(["a", [1]])
    (True, True)
    """
    kind = str if isinstance(batch[0], str) else list
    return not all(isinstance(item, kind) for item in batch)


def out_of_vocabulary(token_id: int, max_token_id: int) -> str:
    """What a prompt with ``token_id`` past the model's largest id ``max_token_id`` is told (vLLM's words first)."""
    return f"Token id {token_id} is out of vocabulary (the model's largest is {max_token_id})"


def request_ints(values: list[Any]) -> list[int] | None:
    """A request's list of ints as vLLM's request models (pydantic, lax ``list[int]``) read it: each item by
    :func:`request_int`; None when one is no such int. O(len(values)).

    >>> request_ints([1, True, 2.0, "3"]), request_ints([1, 1.5])
    ([1, 1, 2, 3], None)
    """
    ids: list[int] = []
    for value in values:
        number = request_int(value)
        if number is None:
            return None
        ids.append(number)
    return ids


# pydantic's integer strings: ASCII digits, single underscores between them, a fraction of zeros, any Unicode
# whitespace around (a no-break space too).
_INT_TEXT = re.compile(r"\s*([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?\s*")
_MAX_INT_TEXT = 4300  # digits Python's int() reads from a string; pydantic refuses longer ones too


_BOOLEAN_WORDS = MappingProxyType(
    {
        **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
        **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
    }
)
