"""Text and chat prompts to token ids, as the engine will see them: the model's tokenizer and chat template.

:class:`PromptEncoder` loads a local ``tokenizer.json`` (a file, or a model folder holding one). Chat messages are
rendered with the model's chat template when the folder has one (found as transformers finds it:
``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja`` first, else ``chat_template`` in
``tokenizer_config.json``; a multimodal processor's own for a chat without tools, the ``tool_use`` one for a chat
with tools),
as vLLM's OpenAI server (0.33, with transformers 5) renders them, then tokenized without adding special tokens (the
template writes them):

- each message becomes what vLLM passes the template: its ``role``; its ``content`` as content parts when the
  template loops over a message's content (vLLM's ``auto`` content format: text parts, media as ``{"type":
  "image"}`` and the like), else as one string (text parts joined by newlines, a null content ``""``); a system
  message without Claude Code's billing header line (it differs in every request); an assistant's ``tool_calls``
  with their ``arguments`` as objects (JSON text parsed; anything else ``{}``; an empty list dropped) and its
  ``reasoning`` (or ``reasoning_content``); a tool message's ``tool_call_id``, its text parts joined; a string
  ``name`` and ``task``; other keys, and null values, dropped; ``developer`` messages made system ones, merged at the
  start, for a template that never names that role;
- the template sees ``tools`` and ``documents`` (none unless given), ``add_generation_prompt`` (true unless given),
  the chat template kwargs a request gives (merged as vLLM merges them), and ``continue_final_message`` cuts the
  output after the final message;
- it renders as transformers renders it for vLLM: loop controls, ``{% generation %}`` blocks, ``raise_exception()``,
  ``strftime_now()``, ``tojson`` with its arguments.

:meth:`PromptEncoder.encode_chat_request` reads these from an OpenAI chat completion body (its ``tools`` as vLLM
validates and dumps them, its ``reasoning_effort`` as a template variable). Without a template, messages are
serialised as::

    <|role|>
    content
    ...
    <|assistant|>

one block per message (list contents joined by their ``text`` parts), which keeps conversations that share their
first messages sharing a token prefix, though not the engine's exact tokens.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from tokenizers import Tokenizer

from prefixroute._numbers import check_flag
from prefixroute.adapters.serve.contract import json_type, request_flag
from prefixroute.adapters.tokenize import PromptTokenizer, check_chat, is_folder, serialise_chat, tokenizer_path
from prefixroute.errors import ConfigurationError, InvalidPromptError, InvalidTypeError

__all__ = ["PromptEncoder"]


class PromptEncoder:
    """Encode text prompts and chat messages with one model's tokenizer (thread-safe).

    ``clock`` is what a chat template's ``strftime_now()`` reads: seconds since the epoch, shown in local time as
    transformers' ``datetime.now()`` is (default :func:`time.time`; a fixed one keeps a dated template's tokens, and a
    test's routing, the same across midnight).

    Raises:
        ConfigurationError: the path holds no tokenizer.json, the file is not one or has an empty vocabulary, or the
            chat template does not compile.
        TypeError: ``path`` is not a str or path, or ``clock`` is not a callable.
    """

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time) -> None:
        if not callable(clock):
            raise InvalidTypeError(
                f"PromptEncoder clock must be a callable returning seconds since the epoch, not {type(clock).__name__}"
            )
        location = tokenizer_path(path)
        file = location / "tokenizer.json" if is_folder(location) else location
        PromptTokenizer.from_file(file)  # its checks and messages for a missing or malformed file
        tokenizer = Tokenizer.from_file(str(file))
        self._text = PromptTokenizer(tokenizer)
        self._chat = PromptTokenizer(tokenizer, add_special_tokens=False)
        vocabulary = tokenizer.get_vocab(with_added_tokens=True)
        if not vocabulary:
            raise ConfigurationError(
                f"{str(file)!r} has an empty vocabulary, which encodes every prompt to no tokens: pass the model's "
                "own tokenizer.json"
            )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        """Token ids at or above this are out of the model's range."""
        largest = max(vocabulary.values())
        model_vocab_size = _model_vocab_size(file.parent)
        self.max_token_id: int = largest if model_vocab_size is None else max(largest, model_vocab_size - 1)
        """The largest token id the engine takes in a prompt, as vLLM checks it: the larger of the tokenizer's largest
        id and the model's ``vocab_size`` - 1 (from ``config.json`` beside ``tokenizer.json``, its ``text_config``'s
        first; a model's vocabulary may be padded past its tokenizer's, as Qwen's is)."""
        templates = _load_templates(file.parent, clock=clock)
        self._template = templates.get("processor", templates.get("default"))  # vLLM's choice for a chat without tools
        self._tool_template = templates.get("tool_use", templates.get("default"))  # transformers' for one with tools

    @property
    def has_chat_template(self) -> bool:
        """Whether chat messages are rendered with the model's own template."""
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, special tokens added as the tokenizer defines unless ``add_special_tokens``
        is False (a completion request's field in vLLM, for a prompt that already holds them). O(len(text)).

        Raises:
            ConfigurationError: ``add_special_tokens`` is not True or False.
        """
        return (self._text if check_flag(add_special_tokens, "add_special_tokens") else self._chat).encode(text)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of chat messages, rendered as vLLM renders them (the module docstring says how). O(total length).

        ``tools`` and ``documents`` reach the template as given (JSON-like objects); ``chat_template_kwargs`` are
        more variables for it, merged as vLLM 0.33 merges its request field: one that is null or ``"auto"`` is
        dropped, ``tokenize`` is not the template's, ``chat_template`` is refused (vLLM's default: request
        templates are not trusted), ``tools`` there wins over ``tools``, while ``add_generation_prompt``,
        ``continue_final_message`` and a non-null ``documents`` win over theirs. Without a chat template only
        ``messages`` count. ``add_special_tokens``: the tokenizer's own special tokens (a BOS) are added to the
        rendered text, as vLLM's chat request field asks (the template usually writes them already).

        Raises:
            ConfigurationError: a flag is not True or False.
            InvalidPromptError: a message is not an object with a string ``role``, ``chat_template_kwargs`` is not
                a mapping or names ``chat_template``, both flags are true, or the template rejects the messages (a
                ValueError).
            TypeError: ``messages`` is not a sequence of messages.
        """
        check_chat(messages)
        for position, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str):
                had = "no 'role'" if role is None else f"a 'role' of type {type(role).__name__}"
                raise InvalidPromptError(
                    f"chat message {position} has {had}: each chat message must be an object with a string 'role' "
                    "and a 'content'"
                )
        check_flag(add_generation_prompt, "add_generation_prompt")
        check_flag(continue_final_message, "continue_final_message")
        tokenizer = self._text if check_flag(add_special_tokens, "add_special_tokens") else self._chat
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidPromptError(
                f"chat_template_kwargs must be an object, not {type(chat_template_kwargs).__name__}"
            )
        given = {key: value for key, value in (chat_template_kwargs or {}).items() if not _unset(value)}
        if "chat_template" in given:  # vLLM's default: --trust-request-chat-template unset
            raise InvalidPromptError(
                "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
                "with untrusted chat template."
            )
        given.pop("tokenize", None)  # apply_chat_template's own argument, never the template's
        variables: dict[str, Any] = {"tools": tools} if tools is not None else {}
        variables |= given
        variables |= {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        if documents is not None:
            variables["documents"] = documents
        template = self._template if variables.get("tools") is None else self._tool_template  # transformers' choice
        if template is None:
            return tokenizer.encode(serialise_chat(messages))
        if add_generation_prompt and continue_final_message:  # transformers' check
            raise InvalidPromptError(
                "continue_final_message and add_generation_prompt are not compatible: continue the final message, "
                "or add a header that prompts a new assistant message"
            )
        conversation = _conversation(messages, parts=template.content_parts, developer=template.developer)
        try:
            text = template.render(conversation, **variables)
        except Exception as exc:  # the template's own raise_exception(), or a jinja error on odd messages
            detail = str(exc) or type(exc).__name__  # a MemoryError says nothing else
            raise InvalidPromptError(f"the model's chat template rejected the messages: {detail}") from exc
        return tokenizer.encode(text)

    def encode_chat_request(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of an OpenAI chat completion request, rendered as vLLM's server renders it. O(body).

        Reads ``messages``, ``tools`` (each checked and dumped as vLLM's request model does: ``{"type":
        "function", "function": {"name", "description", "parameters"}}`` with absent fields null),
        ``documents``, ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
        ``reasoning_effort`` (a template variable, and ``enable_thinking`` = not "none" unless the kwargs set it)
        and ``add_special_tokens`` (both of the first two flags true is vLLM's 400), then calls :meth:`encode_chat`.

        Raises:
            InvalidPromptError: a field is not as vLLM's server takes it (the message names it), or as
                :meth:`encode_chat` raises.
            TypeError: ``body`` is not a mapping, or its ``messages`` not a sequence of messages.
        """
        if not isinstance(body, Mapping):
            raise InvalidTypeError(f"a chat request body must be an object, not {type(body).__name__}")
        add_generation_prompt = request_flag(body, "add_generation_prompt", default=True)
        continue_final_message = request_flag(body, "continue_final_message", default=False)
        if add_generation_prompt and continue_final_message:
            raise InvalidPromptError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        documents = body.get("documents")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(document, dict) for document in documents)
        ):
            raise InvalidPromptError("'documents' must be a list of objects (or null)")
        given = body.get("chat_template_kwargs")
        if given is not None and not isinstance(given, Mapping):
            raise InvalidPromptError(f"chat_template_kwargs must be an object, not {type(given).__name__}")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in _EFFORTS:
            raise InvalidPromptError(
                f"'reasoning_effort' must be one of {', '.join(_EFFORTS)} (or null), not {effort!r}"
            )
        kwargs = dict(given or {})
        if effort is not None:  # vLLM 0.33: the template sees it, and it switches thinking unless the kwargs do
            kwargs["reasoning_effort"] = effort
            if "enable_thinking" not in (given or {}):
                kwargs["enable_thinking"] = effort != "none"
        return self.encode_chat(
            body.get("messages"),  # type: ignore[arg-type]  # check_chat's TypeError names what it is
            tools=_dumped_tools(body.get("tools")),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=kwargs,
            add_special_tokens=request_flag(body, "add_special_tokens", default=False),
        )


def _unset(value: object) -> bool:
    """Whether vLLM drops a request's template kwarg as not set: null or ``"auto"``."""
    return value is None or isinstance(value, str) and value == "auto"


_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""vLLM's ``reasoning_effort`` values."""
_TEXT_PARTS = MappingProxyType(
    {
        "text": "text",
        "input_text": "text",
        "output_text": "text",
        "refusal": "refusal",
        "thinking": "thinking",
    }
)
"""The content parts vLLM takes as text, and the key holding each one's text."""
_MEDIA = MappingProxyType(
    {
        **dict.fromkeys(("image_url", "input_image", "image_pil", "image_embeds"), "image"),
        **dict.fromkeys(("audio_url", "input_audio", "audio_embeds"), "audio"),
        **dict.fromkeys(("video_url", "video_embeds"), "video"),
    }
)
"""vLLM's media parts, and the medium each stands for in a template's content parts."""
_BILLING_HEADER = "x-anthropic-billing-header"
"""The first line of Claude Code's system prompt, different in every request, which vLLM drops (its cache would
miss from there on)."""


def _conversation(messages: Sequence[Mapping[str, Any]], *, parts: bool, developer: bool) -> list[dict[str, Any]]:
    """The messages as vLLM 0.33 hands them to the template (the module docstring lists what it keeps), their
    contents as parts when the template loops over them (``parts``), else as strings; ``developer`` messages made
    ``system`` ones and merged at the start when the template never names that role (``developer`` false); keys
    whose value is null dropped and transformers' reasoning aliases added, as transformers does."""
    conversation = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        if role == "system":
            content = _without_billing_header(content)
        turn: dict[str, Any] = {"role": role, "content": _parts(content) if parts else _text(content)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and not calls:
                pass  # vLLM drops an empty list, keeping the template on its plain assistant path
            elif calls is not None:
                turn["tool_calls"] = [_parsed_call(call) for call in calls] if isinstance(calls, list) else calls
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")  # the older name, which vLLM renames
            if reasoning is not None:
                turn = {"thinking": reasoning, **turn, "reasoning": reasoning, "reasoning_content": reasoning}
        elif role == "tool":
            turn["tool_call_id"] = message.get("tool_call_id")
            if isinstance(turn["content"], list) and all(_is_text_part(part) for part in turn["content"]):
                turn["content"] = "\n".join(str(part.get("text") or "") for part in turn["content"])
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                turn[key] = message[key]
        if role == "developer":
            turn["tools"] = message.get("tools")
        conversation.append({key: value for key, value in turn.items() if value is not None})
    if not developer and any(turn["role"] == "developer" for turn in conversation):
        conversation = _developer_as_system(conversation)
    return conversation


def _is_text_part(part: object) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text"


def _without_billing_header(content: object) -> object:
    """A system message's content without Claude Code's billing header line (a text that starts with it loses its
    first line, and goes when nothing is left), as vLLM parses it."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return content
    kept: list[object] = []
    for part in content:
        text = part if isinstance(part, str) else part.get("text") if _is_text_part(part) else None
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            kept.append(part)
        elif rest := text.partition("\n")[2]:
            kept.append(rest if isinstance(part, str) else {**part, "text": rest})
    return kept


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rewrite for a template that never names the ``developer`` role: developer messages become system ones
    (their ``tools`` dropped), and when that leaves a system message past the first, every system message's text is
    merged into one at the start (joined by blank lines; list contents by newlines)."""
    turns = [
        {key: value for key, value in turn.items() if key != "tools"} | {"role": "system"}
        if turn["role"] == "developer"
        else turn
        for turn in conversation
    ]
    systems = [i for i, turn in enumerate(turns) if turn["role"] == "system"]
    if systems in ([], [0]):
        return turns
    texts = []
    for i in systems:
        content = turns[i].get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] if isinstance(part, Mapping) else part
                for part in content
                if isinstance(part, str) or isinstance(part, Mapping) and "text" in part
            )
        if content:
            texts.append(content)
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged, *(turn for turn in turns if turn["role"] != "system")]


def _text(content: object) -> object:
    """A message's content as vLLM passes it to a string-content template: a string as is, null as ``""``, a list
    of parts as its non-empty text parts (plain strings, text, input/output text, refusal and thinking parts, a tool
    reference's name) joined by newlines; anything else as is (the engine refuses it)."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, Mapping):
            kind = _kind(part)
            part = (
                part.get(_TEXT_PARTS[kind])
                if kind is not None and kind in _TEXT_PARTS
                else part.get("name")
                if kind == "tool_reference"
                else None
            )
        if isinstance(part, str) and part:
            texts.append(part)
    return "\n".join(texts)


def _parts(content: object) -> object:
    """A message's content as vLLM passes it to a template that loops over content parts: a string as one text
    part, null as no part, each part of a list as ``{"type": "text", "text": ...}`` (a plain string, or a text,
    input/output text, refusal or thinking part; a null text or refusal left out), ``{"type": "image" | "audio" |
    "video"}`` (a media part, whose placeholder the template writes) or ``{"type": "tool_reference", "name": ...}``;
    anything else as is."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return content
    result: list[object] = []
    for part in content:
        if isinstance(part, str):
            result.append({"type": "text", "text": part})
        elif isinstance(part, Mapping):
            kind = _kind(part)
            if kind is None:
                continue
            if kind in _TEXT_PARTS:
                text = part.get(_TEXT_PARTS[kind])
                if text is not None or kind not in ("text", "refusal"):
                    result.append({"type": "text", "text": text})
            elif kind in _MEDIA:
                result.append({"type": _MEDIA[kind]})
            elif kind == "tool_reference":
                result.append({"type": "tool_reference", "name": part.get("name")})
    return result


def _kind(part: Mapping[str, Any]) -> str | None:
    """A content part's type; without one (vLLM's simple forms), the medium its key names, a tool reference, or
    text (vLLM refuses that; routing takes it as text)."""
    kind = part.get("type")
    if kind is None:
        return next((key for key in (*_MEDIA, "tool_reference") if key in part), "text")
    return kind if isinstance(kind, str) else None


def _loops_over_content(tree: Any) -> bool:
    """Whether a template (its parsed tree) loops over a message's content, as vLLM 0.33's ``auto`` content format
    detects it. A ``for`` over ``messages`` gives a message name; so does one over a name set from ``messages``, a
    namespace attribute holding it (``namespace(rest=messages)``, ``ns.rest = messages``) or such a name in turn,
    through filters, tests and slices. Content is looped over by a ``for`` over a message name's ``content``; by one,
    inside a macro, over a parameter the macro is called with a message's content for; or by one outside macros over
    a name ``content``. A loop over messages or content with a target that is no plain name makes vLLM give up and
    pass strings. O(size of the template)."""
    import jinja2.nodes as nodes

    def loads(node: Any, name: str) -> bool:
        if isinstance(node, nodes.Name):
            return node.ctx == "load" and node.name == name
        base, _, attribute = name.rpartition(".")  # a namespace attribute: "ns.rest"
        return bool(base) and isinstance(node, nodes.Getattr) and node.attr == attribute and loads(node.node, base)

    def reaches(node: Any, name: str, key: str | None = None) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        ):
            if node.node is None:  # a filter block
                return False
            node = node.node
        if key is None:
            return loads(node, name)
        if isinstance(node, nodes.Getitem):
            return loads(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        return isinstance(node, nodes.Getattr) and loads(node.node, name) and node.attr == key

    def dotted(node: Any) -> str | None:
        if isinstance(node, nodes.NSRef):
            return f"{node.name}.{node.attr}"
        attributes = []
        while isinstance(node, nodes.Getattr):
            attributes.append(node.attr)
            node = node.node
        return ".".join([node.name, *reversed(attributes)]) if isinstance(node, nodes.Name) else None

    lists, pending = ["messages"], ["messages"]
    while pending:  # names and namespace attributes set from messages, or from such a name
        source = pending.pop(0)
        for assign in tree.find_all(nodes.Assign):
            target, value = assign.target, assign.node
            names: list[str | None] = []
            if isinstance(target, nodes.Name) and reaches(value, source):
                names.append(target.name)
            if isinstance(target, nodes.Name) and isinstance(value, nodes.Call):
                if isinstance(value.node, nodes.Name) and value.node.name == "namespace":
                    names += [f"{target.name}.{kw.key}" for kw in value.kwargs if reaches(kw.value, source)]
            elif isinstance(target, (nodes.Getattr, nodes.NSRef)) and reaches(value, source):
                names.append(dotted(target))
            for name in names:
                if name is not None and name not in lists:
                    lists.append(name)
                    pending.append(name)
    loops = list(tree.find_all(nodes.For))
    messages = []
    for loop in loops:
        if any(reaches(loop.iter, name) for name in lists):
            if not isinstance(loop.target, nodes.Name):
                return False
            messages.append(loop.target.name)

    def takes_content(argument: Any) -> bool:
        return any(reaches(argument, name, "content") for name in messages)

    content_parameters: dict[int, set[str]] = {}  # loops inside a macro -> its parameters given a content
    for macro in tree.find_all(nodes.Macro):
        parameters = {argument.name for argument in macro.args}
        given = set()
        for call in tree.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                given |= {macro.args[i].name for i, a in enumerate(call.args[: len(macro.args)]) if takes_content(a)}
                given |= {kw.key for kw in call.kwargs if kw.key in parameters and takes_content(kw.value)}
        for loop in macro.find_all(nodes.For):
            content_parameters[id(loop)] = given
    for loop in loops:
        over = loop.iter
        # inside a macro: over a parameter given a content; outside: over a name "content"
        contents = content_parameters.get(id(loop), {"content"})
        if takes_content(over) or isinstance(over, nodes.Name) and over.name in contents:
            return isinstance(loop.target, nodes.Name)
    return False


def _parsed_call(call: object) -> object:
    """A tool call with its ``function.arguments`` as vLLM 0.33 hands it to templates: an object kept, JSON text
    that holds an object parsed, anything else (empty, absent, not JSON, not an object) ``{}``. A copy: the request
    is left as it came. A call that is no function call object is kept as it is: vLLM refuses it, and routing it
    costs nothing (the sidecar's contract routes every message a client may send)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = call["function"]
    arguments = function.get("arguments")
    if arguments and isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _dumped_tools(tools: object) -> list[dict[str, Any]] | None:
    """A request's ``tools`` as vLLM 0.33 hands them to the template: each validated as its
    ``ChatCompletionToolsParam`` and dumped with its declared fields only: ``{"type": "function", "function":
    {"name", "description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}``, the optional ones
    when given (a tool's ``defer_loading`` also its function's, unless that has its own).

    Raises:
        InvalidPromptError: ``tools`` is not a non-empty list of such objects (naming the first wrong field).
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidPromptError(f"'tools' must be a list of tool objects (or null), not {json_type(tools)}")
    if not tools:  # vLLM's check and words
        raise InvalidPromptError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."
        )
    dumped = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise InvalidPromptError(
                f'tools[{i}] must be an object like {{"type": "function", "function": {{"name": ...}}}}'
            )
        if tool.get("type", "function") != "function":
            raise InvalidPromptError(f'tools[{i}].type must be "function", not {json_type(tool["type"])}')
        for name, kind, said in _FUNCTION_FIELDS:
            if not isinstance(function.get(name), kind):
                raise InvalidPromptError(
                    f"tools[{i}].function.{name} must be {said}, not {json_type(function.get(name))}"
                )
        spec = {name: function.get(name) for name, _, _ in _FUNCTION_FIELDS[:3]}
        deferred = _optional_flag(tool, "defer_loading", f"tools[{i}]")
        for name in ("strict", "defer_loading"):
            value = _optional_flag(function, name, f"tools[{i}].function")
            if value is None and name == "defer_loading":
                value = deferred
            if value is not None:
                spec[name] = value
        dumped.append(
            {"type": "function", "function": spec} | ({} if deferred is None else {"defer_loading": deferred})
        )
    return dumped


def _optional_flag(holder: Mapping[str, Any], name: str, where: str) -> bool | None:
    """An optional boolean field of a tool, read as pydantic reads one (None when absent or null).

    Raises:
        InvalidPromptError: it is no boolean.
    """
    if holder.get(name) is None:
        return None
    try:
        return request_flag(holder, name, default=False)
    except InvalidPromptError:
        raise InvalidPromptError(f"{where}.{name} must be true, false or null, not {json_type(holder[name])}") from None


_FUNCTION_FIELDS = (
    ("name", str, "a string"),
    ("description", (str, type(None)), "a string or null"),
    ("parameters", (dict, type(None)), "an object or null"),
)
"""vLLM's ``FunctionDefinition``: its declared fields in order (``strict`` and ``defer_loading`` apart), what each
takes, and how to say it."""


def _model_vocab_size(folder: Path) -> int | None:
    """The model's vocabulary size as vLLM reads it (``vocab_size`` of ``config.json``'s ``text_config`` when it has
    one, else its own), or None when the folder has no ``config.json`` or it gives none.

    Raises:
        ConfigurationError: ``config.json`` is not a readable JSON object.
    """
    file = folder / "config.json"
    if not file.is_file():
        return None
    config = _json_object(file)
    text_config = config.get("text_config")
    for source in (text_config if isinstance(text_config, dict) else {}, config):
        size = source.get("vocab_size")
        if type(size) is int and size > 0:
            return size
    return None


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object ``file`` holds.

    Raises:
        ConfigurationError: the file is not readable JSON, or holds something else than an object.
    """
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{str(file)!r} is not readable JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigurationError(f"{str(file)!r} must hold a JSON object, not {type(value).__name__}")
    return value


def _template_sources(folder: Path) -> tuple[dict[str, tuple[str, str]], dict[str, Any]]:
    """The folder's chat templates by name (each with where it comes from, for messages), as transformers loads
    them for vLLM, and its ``tokenizer_config.json`` (``{}`` without one). The tokenizer's: ``chat_template.jinja``
    (the default) and ``additional_chat_templates/NAME.jinja`` when there are any, which take priority; else the
    config's ``chat_template`` (a str, or a list of named ones). A multimodal model's processor (the folder has a
    ``preprocessor_config.json`` or ``processor_config.json``) may have its own, named "processor" here, which vLLM
    prefers for a chat without tools: ``processor_config.json``'s ``chat_template``, else ``chat_template.json``'s.

    Raises:
        ConfigurationError: a file is not readable, or not of the form said.
    """
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        config = _json_object(config_file)
    files = [folder / "chat_template.jinja"]
    if (folder / "additional_chat_templates").is_dir():
        files += sorted((folder / "additional_chat_templates").glob("*.jinja"))
    sources = {
        "default" if file.parent == folder else file.stem: (_text_file(file), repr(str(file)))
        for file in files
        if file.is_file()
    }
    template = config.get("chat_template")
    if sources:
        pass
    elif isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise ConfigurationError(
                f'{str(config_file)!r}: a chat_template list must hold {{"name", "template"}} objects'
            )
        sources = {
            t["name"]: (t["template"], f"{str(config_file)!r} ({t['name']!r})")
            for t in template
            if isinstance(t.get("template"), str)
        }
    elif isinstance(template, str):
        sources = {"default": (template, repr(str(config_file)))}
    if any((folder / name).is_file() for name in ("preprocessor_config.json", "processor_config.json")):
        for file in (folder / "processor_config.json", folder / "chat_template.json"):
            template = _json_object(file).get("chat_template") if file.is_file() else None
            if isinstance(template, str):
                sources["processor"] = (template, repr(str(file)))
                break
    return sources, config


def _text_file(file: Path) -> str:
    """The text of ``file``.

    Raises:
        ConfigurationError: it is not readable UTF-8 text.
    """
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{str(file)!r} is not readable UTF-8 text: {exc}") from exc


class _Template(NamedTuple):
    """A compiled chat template: its render function, whether it loops over a message's content parts, and whether
    it names the ``developer`` role (vLLM's test: the quoted word in its source)."""

    render: Callable[..., str]
    content_parts: bool
    developer: bool


def _load_templates(folder: Path, *, clock: Callable[[], float] = time.time) -> dict[str, _Template]:
    """The folder's chat templates by name (:func:`_template_sources`), each compiled and probed; their
    ``strftime_now()`` reads ``clock``.

    Raises:
        ConfigurationError: as :func:`_template_sources`, or a template does not compile or render in time.
    """
    sources, config = _template_sources(folder)
    if not sources:
        return {}
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.compiler import CodeGenerator, Frame
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedConcat(CodeGenerator):
        """Jinja's code generator, with ``~`` joined by :meth:`Bounded.joined` (Jinja has no hook for it)."""

        def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
            self.write("environment.joined((")
            for argument in node.nodes:
                self.visit(argument, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        """Jinja's sandbox, with ``*``, ``**``, ``+`` and ``~`` refused when they would build something huge (a
        template that doubles a string or squares a number in a loop fills the memory, or spins in C, before its
        output is seen)."""

        intercepted_binops = frozenset(("*", "**", "+"))
        code_generator_class = BoundedConcat

        def joined(self, values: Sequence[Any]) -> str:
            texts = [str(value) for value in values]
            if sum(map(len, texts)) > _MAX_TEMPLATE_CHARS:
                raise ValueError(f"the chat template joins strings (~) of over {_MAX_TEMPLATE_CHARS:,} characters")
            return "".join(texts)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if (
                operator == "+"
                and isinstance(left, (str, list, tuple))
                and isinstance(right, (str, list, tuple))
                and len(left) + len(right) > _MAX_TEMPLATE_CHARS
            ):
                raise ValueError(f"the chat template adds sequences (+) of over {_MAX_TEMPLATE_CHARS:,} items")
            sized = isinstance(left, (str, list, tuple)) and isinstance(right, int)
            if operator == "*" and (sized or isinstance(right, (str, list, tuple)) and isinstance(left, int)):
                length, times = (len(left), right) if sized else (len(right), left)
                if length * times > _MAX_TEMPLATE_CHARS:
                    raise ValueError(f"the chat template repeats a sequence {times:,} times: over the output limit")
            if operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"the chat template raises a number to the power {right:,}")
            if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
                bits = left.bit_length() + right.bit_length() if operator == "*" else left.bit_length() * abs(right)
                if bits > _MAX_INT_BITS:  # squared in a loop, a number takes minutes of C per step, past the probe
                    raise ValueError(f"the chat template computes a number of over {_MAX_INT_BITS:,} bits")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def strftime_now(format: str) -> str:
        return datetime.fromtimestamp(clock()).strftime(format)  # local time, as transformers' datetime.now()

    class Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}`` block (it marks the assistant's tokens), rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    # As transformers' apply_chat_template, which vLLM renders chats with: its extensions, globals and filters.
    environment = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation])
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.filters["tojson"] = _tojson
    specials = _special_tokens(folder, config)
    templates = {}
    for name, (source, origin) in sources.items():
        try:
            compiled = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigurationError(f"the chat template in {origin} does not compile: {exc}") from exc
        render = _renderer(compiled, source, specials)
        _check_renders(render, origin)
        developer = '"developer"' in source or "'developer'" in source
        templates[name] = _Template(render, _loops_over_content(environment.parse(source)), developer)
    return templates


def _renderer(compiled: Any, source: str, specials: dict[str, str]) -> Callable[..., str]:
    """The render function of one compiled template."""

    def render(
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Any = None,
        documents: Any = None,
        **variables: Any,
    ) -> str:
        """The rendered text (transformers' ``render_jinja_template``), refused once it grows past
        ``_MAX_TEMPLATE_CHARS`` (a runaway template).

        Raises:
            ValueError: the template raised, or the final message to continue is not in its output.
        """
        final = ""
        if continue_final_message:  # as transformers does it: mark the end of the final message, cut there
            value = messages[-1].get("content") if messages else None
            if value is None:
                raise ValueError('continue_final_message is set but the final message has no "content" to continue')
            if "content" not in source:
                raise ValueError(
                    'continue_final_message is set to "content" but this is not an accepted field in the chat_template'
                )
            if isinstance(value, list):  # content parts: the last one with a text
                at = next((i for i in reversed(range(len(value))) if _has_text(value[i])), None)
                if at is None:
                    raise ValueError("continue_final_message is set but the final message has no text to continue")
                final = str(value[at]["text"])
                value = [*value[:at], {**value[at], "text": final + _CONTINUE_TAG}, *value[at + 1 :]]
            else:
                final = str(value)
                value = final + _CONTINUE_TAG
            messages = [*messages[:-1], {**messages[-1], "content": value}]
        parts: list[str] = []
        size = 0
        chunks = compiled.generate(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**specials, **variables},
        )
        for part in chunks:
            size += len(part)
            if size > _MAX_TEMPLATE_CHARS:
                raise ValueError(f"the chat template's output is over {_MAX_TEMPLATE_CHARS:,} characters")
            parts.append(part)
        text = "".join(parts)
        if continue_final_message:
            if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError(
                    "continue_final_message is set but the final message does not appear in the chat after applying "
                    "the chat template"
                )
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text

    return render


def _has_text(part: object) -> bool:
    return isinstance(part, Mapping) and "text" in part


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""What transformers appends to the final message to find where it ends in the output (its own marker)."""
_MAX_TEMPLATE_CHARS = 64 << 20
"""A rendered conversation longer than this (64 Mi characters, far past any model's context) is a runaway template."""
_MAX_EXPONENT = 4096
_MAX_INT_BITS = 1 << 16
"""The largest number a template may compute with ``*`` or ``**`` (about 19,700 digits, past what it can print)."""
_MAX_JSON_INDENT = 256
"""The longest indent or separator ``tojson`` takes (a huge one builds gigabytes inside json.dumps, past any check)."""
_PROBE_SECONDS = 5.0
_PROBE_CONVERSATION = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi. How can I help?"},
    {"role": "user", "content": "Say goodbye."},
)


class _Stopped(Exception):
    """Raised into a template probe that ran past its time."""


def _check_renders(render: Callable[..., str], origin: str) -> None:
    """Refuse a template that does not render a short conversation within ``_PROBE_SECONDS`` (a loop without end:
    Jinja has no step limit). It renders on a thread of its own under a trace function, which stops it at the next
    line once the time is up (so nothing is left running); whether it accepts or rejects the conversation does not
    matter here."""
    stop = threading.Event()

    def stopping(frame: Any, event: str, arg: Any) -> Any:
        if stop.is_set():
            raise _Stopped
        return stopping

    def probe() -> None:
        sys.settrace(stopping)  # this thread only
        try:
            render([dict(m) for m in _PROBE_CONVERSATION])
        except Exception:  # a template may reject the probe: only its time matters here
            pass
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=probe, name="prefixroute-template-probe", daemon=True)
    thread.start()
    thread.join(_PROBE_SECONDS)
    if thread.is_alive():
        stop.set()
        thread.join(_PROBE_SECONDS)
        raise ConfigurationError(
            f"the chat template in {origin} did not render a four-message conversation within "
            f"{_PROBE_SECONDS:g} s: it loops without end (fix the template, or remove it to use the default)"
        )


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` filter (the same arguments), with its indent and separators bounded.

    Raises:
        ValueError: the indent or a separator is longer than ``_MAX_JSON_INDENT``.
    """
    widths = [len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0]
    if isinstance(separators, (list, tuple)):
        widths += [len(separator) for separator in separators if isinstance(separator, str)]
    if max(widths) > _MAX_JSON_INDENT:
        raise ValueError(
            f"the chat template's tojson takes an indent or separator of at most {_MAX_JSON_INDENT} characters, "
            f"not {max(widths):,}"
        )
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _special_tokens(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens transformers passes a template (its ``special_tokens_map``): each of bos, eos, unk,
    sep, pad, cls and mask that ``tokenizer_config.json``, else ``special_tokens_map.json``, gives a text for (a str,
    or ``{"content": ...}`` in older files); one without a text is not passed (undefined in the template).

    Raises:
        ConfigurationError: ``special_tokens_map.json`` is not a readable JSON object.
    """
    file = folder / "special_tokens_map.json"
    fallback = _json_object(file) if file.is_file() else {}
    specials = {}
    for name in _SPECIAL_TOKENS:
        token = config[name] if name in config else fallback.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            specials[name] = token
    return specials


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
