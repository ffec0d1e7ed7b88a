"""Text and chat prompts to token ids, as the engine will see them: the model's tokenizer and chat template.

:class:`PromptEncoder` loads a local ``tokenizer.json`` (a file, or a model folder holding one). Chat messages are
rendered with the model's chat template when the folder has one (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja``), with ``add_generation_prompt=True`` as vLLM's OpenAI server does (a content given as a
list of parts becomes its text parts joined by newlines, as vLLM passes it to a template that expects a string), then
tokenized without adding special tokens (the template writes them). It renders as transformers renders it for vLLM:
loop controls, ``{% generation %}`` blocks, ``raise_exception()``, ``strftime_now()``, ``tojson`` with its arguments,
``tools`` and ``documents`` none. Without a template, messages are serialised as::

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
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from prefixroute.adapters.tokenize import PromptTokenizer, check_chat, is_folder, serialise_chat, tokenizer_path
from prefixroute.errors import ConfigurationError, InvalidPromptError

__all__ = ["PromptEncoder"]


class PromptEncoder:
    """Encode text prompts and chat messages with one model's tokenizer (thread-safe).

    Raises:
        ConfigurationError: the path holds no tokenizer.json, the file is not one or has an empty vocabulary, or the
            chat template does not compile.
        TypeError: ``path`` is not a str or path.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
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
        self._template = _load_template(file.parent)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat messages are rendered with the model's own template."""
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt (special tokens added as the tokenizer defines). O(len(text))."""
        return self._text.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of chat messages with the generation prompt appended. O(total length).

        Raises:
            InvalidPromptError: a message is not an object with a string ``role``, or the template rejects the
                messages (a ValueError).
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
        if self._template is None:
            return self._chat.encode(serialise_chat(messages))
        try:
            text = self._template(messages=[_flattened(m) for m in messages], add_generation_prompt=True)
        except Exception as exc:  # the template's own raise_exception(), or a jinja error on odd messages
            detail = str(exc) or type(exc).__name__  # a MemoryError says nothing else
            raise InvalidPromptError(f"the model's chat template rejected the messages: {detail}") from exc
        return self._chat.encode(text)


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


def _flattened(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """``message`` with a list content (OpenAI's content parts) as one string of its text parts joined by newlines,
    as vLLM renders them for a template that expects string contents (most do); other messages unchanged."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = (part.get("text") for part in content if isinstance(part, Mapping) and part.get("type", "text") == "text")
    return {**message, "content": "\n".join(text for text in texts if isinstance(text, str))}


def _load_template(folder: Path) -> Callable[..., str] | None:
    """The folder's chat template as a render function, or None when it has none."""
    source: str | None = None
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        config = _json_object(config_file)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
                raise ConfigurationError(
                    f'{str(config_file)!r}: a chat_template list must hold {{"name", "template"}} objects'
                )
            template = next((t.get("template") for t in template if t["name"] == "default"), None)
        source = template if isinstance(template, str) else None
    jinja_file = folder / "chat_template.jinja"
    if source is None and jinja_file.is_file():
        try:
            source = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{str(jinja_file)!r} is not readable UTF-8 text: {exc}") from exc
    if source is None:
        return None
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
        return datetime.now().strftime(format)

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
    try:
        compiled = environment.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigurationError(f"the chat template in {str(folder)!r} does not compile: {exc}") from exc
    specials = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(**variables: Any) -> str:
        """The rendered text, refused once it grows past ``_MAX_TEMPLATE_CHARS`` (a runaway template)."""
        parts: list[str] = []
        size = 0
        for part in compiled.generate(**specials, tools=None, documents=None, **variables):
            size += len(part)
            if size > _MAX_TEMPLATE_CHARS:
                raise ValueError(f"the chat template's output is over {_MAX_TEMPLATE_CHARS:,} characters")
            parts.append(part)
        return "".join(parts)

    _check_renders(render, folder)
    return render


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


def _check_renders(render: Callable[..., str], folder: Path) -> None:
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
            render(messages=[dict(m) for m in _PROBE_CONVERSATION], add_generation_prompt=True)
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
            f"the chat template in {str(folder)!r} did not render a four-message conversation within "
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


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        token = token.get("content")
    return token if isinstance(token, str) else ""
