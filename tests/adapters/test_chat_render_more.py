"""More of what a chat request renders to and is refused with, as vLLM and transformers do it: the cases mutation
testing of the chat-rendering code found unchecked (content parts of each kind, tool calls vLLM's parser cannot
read, vLLM's content-format detection, exact refusals, and what the proxy encodes off its event loop)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from prefixroute import ConfigurationError, InvalidPromptError, InvalidTypeError
from prefixroute.adapters.proxy.prompts import INLINE_TEXT, ByteEncoder, request_tokens, request_tokens_async
from prefixroute.adapters.serve.text import PromptEncoder

from .conftest import LoopNoting
from .test_chat_render import CALL, CALL_PARSED, TOOLS_TEMPLATE, _decoded, byte_tokenizer, transformers_text

# A template that loops over content parts and writes each kind its own way: a plain string part in brackets, a
# text part's text (a null one as Jinja writes it, "None"), a media part as its type.
EVERY_PART_TEMPLATE = """{% for m in messages %}<|{{ m.role }}|>{% for part in m.content %}
{%- if part is string %}[{{ part }}]{% elif part.type == 'text' %}{{ part.text }}{% else %}<{{ part.type }}>{% endif %}
{%- endfor %}<|end|>{% endfor %}"""

# A template that writes each message's tool calls as JSON, as they reach it.
CALLS_TEMPLATE = """{% for m in messages %}<|{{ m.role }}|>{{ m.content }}
{%- if m.tool_calls is defined %} {{ m.tool_calls | tojson }}{% endif %}<|end|>{% endfor %}"""


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> PromptEncoder:
    return byte_tokenizer(tmp_path_factory.mktemp("model"), TOOLS_TEMPLATE)


def _renders_as_transformers(
    encoder: PromptEncoder, template: str, body: dict[str, Any], expected: dict[str, Any]
) -> None:
    ours = encoder.encode_chat_request(body)
    theirs = encoder.encode(transformers_text(template, expected))
    assert ours == theirs, (_decoded(encoder, ours), _decoded(encoder, theirs))


def test_each_kind_of_content_part_reaches_a_parts_template_as_vllm_passes_it(tmp_path: Path) -> None:
    """vLLM's ``parse_chat_message_content_part`` for the ``openai`` content format: a plain string part as a text
    part, a thinking part as a text part even without its text (only a null text or refusal is left out), each
    medium as its placeholder part. A part of a type vLLM does not know (its request model refuses it, the engine
    answers 400) is dropped by the router, not the parts after it."""
    encoder = byte_tokenizer(tmp_path / "model", EVERY_PART_TEMPLATE)
    content = [
        "plain",
        {"type": "thinking", "thinking": "hmm"},
        {"type": "thinking"},
        {"type": "text", "text": None},
        {"type": 5, "text": "numbered"},
        {"type": "custom", "text": "unknown"},
        {"type": "input_text", "text": "after"},
        {"type": "video_url", "video_url": {"url": "v"}},
        {"input_audio": {"data": "a"}},
        {"type": "output_text", "text": "last"},
    ]
    parts = [
        {"type": "text", "text": "plain"},
        {"type": "text", "text": "hmm"},
        {"type": "text", "text": None},
        {"type": "text", "text": "after"},
        {"type": "video"},
        {"type": "audio"},
        {"type": "text", "text": "last"},
    ]
    body = {"messages": [{"role": "user", "content": content}]}
    _renders_as_transformers(encoder, EVERY_PART_TEMPLATE, body, {"conversation": [{"role": "user", "content": parts}]})
    assert _decoded(encoder, encoder.encode_chat_request(body)).startswith("<|user|>plainhmm")


def test_a_part_without_a_type_reads_as_text_in_either_content_format(tmp_path: Path) -> None:
    """vLLM's request model refuses a part with neither a ``type`` nor a media key (the engine answers 400); the
    router reads it as a text part in both content formats alike, rather than fail on a request it only routes."""
    part_encoder = byte_tokenizer(tmp_path / "parts", EVERY_PART_TEMPLATE)
    string_encoder = byte_tokenizer(tmp_path / "string", TOOLS_TEMPLATE)
    body = {"messages": [{"role": "user", "content": [{"text": "untyped"}, {"image_url": "x"}]}]}
    expected = {"role": "user", "content": [{"type": "text", "text": "untyped"}, {"type": "image"}]}
    _renders_as_transformers(part_encoder, EVERY_PART_TEMPLATE, body, {"conversation": [expected]})
    _renders_as_transformers(
        string_encoder,
        TOOLS_TEMPLATE,
        body,
        {"conversation": [{"role": "user", "content": "untyped"}], "add_generation_prompt": True},
    )


def test_tool_calls_vllms_parser_cannot_read_reach_the_template_as_sent(tmp_path: Path) -> None:
    """Only a call with a ``function`` object has its arguments parsed; a call without one, or one that is no object,
    is the template's to take or refuse (vLLM's request model refuses it), not a crash of the router."""
    encoder = byte_tokenizer(tmp_path / "model", CALLS_TEMPLATE)
    odd = [{"id": "c0", "type": "function"}, {"id": "c2", "function": "now"}, "raw"]
    body = {"messages": [{"role": "assistant", "content": "", "tool_calls": [*odd, CALL]},
                         {"role": "assistant", "content": "", "tool_calls": "weather(Paris)"}]}  # fmt: skip
    conversation = [{"role": "assistant", "content": "", "tool_calls": [*odd, CALL_PARSED]},
                    {"role": "assistant", "content": "", "tool_calls": "weather(Paris)"}]  # fmt: skip
    _renders_as_transformers(encoder, CALLS_TEMPLATE, body, {"conversation": conversation})


def test_an_assistants_reasoning_reaches_the_template_under_each_of_its_names(tmp_path: Path) -> None:
    """vLLM passes an assistant's ``reasoning``; transformers copies it to ``thinking`` and ``reasoning_content`` (the
    names templates read it by) before it renders."""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.reasoning }}|{{ m.thinking }}|{{ m.reasoning_content }};{% endfor %}"
    )
    encoder = byte_tokenizer(tmp_path / "model", template)
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "reasoning": "hm"}]}
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "reasoning": "hm"}]
    _renders_as_transformers(encoder, template, body, {"conversation": conversation})
    assert _decoded(encoder, encoder.encode_chat_request(body)).endswith("assistant:hm|hm|hm;")


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{% for c in m['tool_calls'] %}{% endfor %}{% endfor %}",
        "{% for m in messages %}{% for c in m.tool_calls %}{% endfor %}{% endfor %}",
        "{% set other = {'content': ''} %}{% for m in messages %}{% for c in other['content'] %}{% endfor %}"
        "{% endfor %}",
        "{% for m in messages %}{% for c in m[key] %}{% endfor %}{% endfor %}",
    ],
)
def test_a_loop_over_another_field_or_another_name_leaves_string_contents(tmp_path: Path, template: str) -> None:
    """vLLM's ``auto`` content format looks for a loop over the message's ``content`` only: by attribute or by a
    constant key, of the message name itself."""
    encoder = byte_tokenizer(tmp_path / "model", template + "{{ messages[0].content }}")
    rendered = _decoded(encoder, encoder.encode_chat([{"role": "user", "content": "hi"}]))
    assert rendered == "hi"


def test_a_continue_final_message_in_the_template_kwargs_is_not_followed(encoder: PromptEncoder) -> None:
    """vLLM 0.33 merges the request's own ``continue_final_message`` (false unless set) over
    ``chat_template_kwargs``, so one there, even a field name transformers would take, changes nothing."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": "", "reasoning": "let me"},
    ]
    body = {"messages": messages, "add_generation_prompt": False,
            "chat_template_kwargs": {"continue_final_message": "reasoning_content"}}  # fmt: skip
    final = {
        "thinking": "let me",
        "role": "assistant",
        "content": "",
        "reasoning": "let me",
        "reasoning_content": "let me",
    }
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count"}, final]
    expected = {"conversation": conversation, "add_generation_prompt": False}
    _renders_as_transformers(encoder, TOOLS_TEMPLATE, body, expected)
    assert _decoded(encoder, encoder.encode_chat_request(body)).endswith("<think>let me</think><|end|>")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], 'the final message has no "content" to continue'),
        # the final message's text is in the output (the user's), but the template does not write the final message
        ([{"role": "user", "content": "Count"}, {"role": "assistant", "content": "Count"}],
         "the final message does not appear in the chat after applying the chat template"),
    ],
)  # fmt: skip
def test_continuing_a_final_message_that_is_not_there_is_refused(
    tmp_path: Path, messages: list[dict[str, Any]], message: str
) -> None:
    """transformers' checks (vLLM's 400): a final message with the field continued, written by the template."""
    template = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% else %}{{ m.content | length }}{% endif %}"
        "{% endfor %}{{ messages[0].name }}"
    )
    encoder = byte_tokenizer(tmp_path / "model", template)
    expected = {"conversation": messages, "continue_final_message": True}
    with pytest.raises(ValueError):
        transformers_text(template, expected)
    with pytest.raises(InvalidPromptError) as refused:
        encoder.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert str(refused.value).startswith("the model's chat template rejected the messages: continue_final_message is")
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"continue_final_message": True}, "Cannot set both `continue_final_message` and `add_generation_prompt` to "
         "True."),
        ({"documents": [["text"]]}, "'documents' must be a list of objects (or null)"),
        ({"tools": [{"function": {"name": True}}]}, "tools[0].function.name must be a string, not a boolean"),
        ({"tools": [{"function": {"name": "f", "description": []}}]},
         "tools[0].function.description must be a string or null, not an array"),
        ({"tools": [{"type": None, "function": {"name": "f"}}]},
         'tools[0].type must be "function", not null (or missing)'),
        ({"add_generation_prompt": {}}, "'add_generation_prompt' must be true or false, not an object"),
        ({"add_special_tokens": ["yes"]}, "'add_special_tokens' must be true or false, not an array"),
    ],
)  # fmt: skip
def test_a_refusal_says_exactly_what_is_wrong(encoder: PromptEncoder, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidPromptError) as refused:
        encoder.encode_chat_request({"messages": [{"role": "user", "content": "Hi"}], **body})
    assert str(refused.value) == message


@pytest.mark.parametrize(("body", "kind"), [([], "list"), (None, "NoneType"), ("Hi", "str")])
def test_a_body_that_is_no_object_is_refused_naming_its_type(encoder: PromptEncoder, body: object, kind: str) -> None:
    with pytest.raises(InvalidTypeError) as refused:
        encoder.encode_chat_request(body)  # type: ignore[arg-type]
    assert str(refused.value) == f"a chat request body must be an object, not {kind}"


class OpaqueEncode:
    """An ``encode`` whose parameters Python cannot read (as for some compiled callables): it takes the text alone."""

    __signature__ = "opaque"

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> list[int]:
        self.texts.append(text)
        return list(text.encode())


def test_an_encoder_whose_encode_cannot_be_inspected_gets_the_text_alone() -> None:
    """``add_special_tokens`` false reaches only an ``encode`` known to take it; one Python cannot inspect gets the
    text alone, as an encoder without the keyword does."""
    encoder = ByteEncoder()
    opaque = OpaqueEncode()
    encoder.encode = opaque  # type: ignore[method-assign]
    body = {"prompt": "Hi", "add_special_tokens": False}
    assert request_tokens(body, chat=False, encoder=encoder) == list(b"Hi")
    assert opaque.texts == ["Hi"]


LONG = "y" * INLINE_TEXT


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "description": LONG}}]},
        {"documents": [{"title": "a", "text": LONG}]},
        {"chat_template_kwargs": {"system_note": LONG}},
    ],
)
def test_a_chats_long_tools_documents_or_template_kwargs_are_encoded_on_a_worker_thread(extra: dict[str, Any]) -> None:
    """A chat template renders them with the messages, so their text counts towards the inline limit."""
    short = {"messages": [{"role": "user", "content": "hi"}]}
    for body, on_loop in ((short, True), ({**short, **extra}, False)):
        encoder = LoopNoting()
        asyncio.run(request_tokens_async(body, chat=True, encoder=encoder))
        assert encoder.on_loop == [on_loop]


@pytest.mark.parametrize(
    ("messages", "had"),
    [
        ([{"content": "Hi"}], "chat message 0 has no 'role'"),
        ([{"role": "user", "content": "Hi"}, {"role": 5, "content": "Hi"}], "chat message 1 has a 'role' of type int"),
    ],
)
def test_a_message_without_a_string_role_is_refused_saying_what_it_has(
    encoder: PromptEncoder, messages: list[dict[str, Any]], had: str
) -> None:
    with pytest.raises(InvalidPromptError) as refused:
        encoder.encode_chat(messages)
    assert str(refused.value) == had + ": each chat message must be an object with a string 'role' and a 'content'"


def test_a_tool_call_id_and_tools_reach_the_template_on_the_roles_vllm_keeps_them_for(tmp_path: Path) -> None:
    """vLLM's ``parse_chat_messages`` keeps ``tool_call_id`` on a tool message only (one without it has none), and
    gives a developer message its ``tools`` (none when it has none: transformers drops a null key); other roles' such
    keys are dropped. (The template names the 'developer' role, so vLLM leaves those messages as they are.)"""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_call_id is defined %} [{{ m.tool_call_id }}]"
        "{% endif %}{% if m.tools is defined %} tools={{ m.tools | tojson }}{% endif %};{% endfor %}"
        "{% if messages[0].role == 'developer' %}.{% endif %}"
    )
    encoder = byte_tokenizer(tmp_path / "model", template)
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": [
        {"role": "developer", "content": "Use f.", "tools": tools},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi", "tool_call_id": "c0", "tools": tools},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rainy"},
    ]}  # fmt: skip
    conversation = [
        {"role": "developer", "content": "Use f.", "tools": tools},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rainy"},
    ]
    _renders_as_transformers(encoder, template, body, {"conversation": conversation})


def test_a_template_that_does_not_compile_is_refused_naming_where_it_is(tmp_path: Path) -> None:
    """One of a ``tokenizer_config.json``'s named templates, or a processor's ``chat_template.json``."""
    folder = tmp_path / "model"
    byte_tokenizer(folder, "")
    config_file, processor_file = folder / "tokenizer_config.json", folder / "chat_template.json"
    config_file.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "{% for %}"}]}))
    with pytest.raises(ConfigurationError) as refused:
        PromptEncoder(folder)
    assert str(refused.value).startswith(f"the chat template in {str(config_file)!r} ('tool_use') does not compile: ")
    config_file.write_text("{}")
    (folder / "preprocessor_config.json").write_text("{}")  # a multimodal model: its processor's template is read
    processor_file.write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ConfigurationError) as refused:
        PromptEncoder(folder)
    assert str(refused.value).startswith(f"the chat template in {str(processor_file)!r} does not compile: ")


@pytest.mark.parametrize(
    "template",
    [
        # the final message written twice: the output is cut at its last copy, as transformers cuts it
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<last>{{ messages[-1].content }}",
        # trimmed, the marker loses its space: the output is cut there, and the spaces before it dropped
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}<|end|>{% endfor %}",
    ],
)
def test_continuing_the_final_message_cuts_where_transformers_cuts(tmp_path: Path, template: str) -> None:
    encoder = byte_tokenizer(tmp_path / "model", template)
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two, "}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    _renders_as_transformers(encoder, template, body, {"conversation": messages, "continue_final_message": True})


def test_a_template_renders_with_transformers_globals_blocks_and_operators(tmp_path: Path) -> None:
    """``strftime_now`` (``%%`` keeps it independent of the clock), ``{% generation %}`` rendered as its body, and
    the ``+``, ``*`` and ``**`` the sandbox checks before it computes them."""
    template = (
        "{{ strftime_now('%%') }}{% for m in messages %}{{ '<' + m.role + '>' }}{% generation %}{{ m.content }}"
        "{% endgeneration %}{{ '-' * 2 }}{{ 2 ** 3 }}{{ loop.index * 10 + 1 }}{% endfor %}"
    )
    encoder = byte_tokenizer(tmp_path / "model", template)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    _renders_as_transformers(encoder, template, {"messages": messages}, {"conversation": messages})
    assert _decoded(encoder, encoder.encode_chat(messages)) == "%<user>Hi--811<assistant>Hello--821"


def test_a_templates_raise_exception_refuses_the_messages_with_its_words(tmp_path: Path) -> None:
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}"
    )
    encoder = byte_tokenizer(tmp_path / "model", template)
    messages = [{"role": "assistant", "content": "Hi"}]
    with pytest.raises(Exception, match="^Conversations must start with a user$"):
        transformers_text(template, {"conversation": messages})
    with pytest.raises(InvalidPromptError) as refused:
        encoder.encode_chat(messages)
    assert str(refused.value) == "the model's chat template rejected the messages: Conversations must start with a user"


def test_block_tags_on_lines_of_their_own_leave_no_whitespace_as_transformers_renders_them(tmp_path: Path) -> None:
    """transformers' environment trims the newline after a block tag and the indent before one (``trim_blocks``,
    ``lstrip_blocks``): a template laid out on indented lines renders without that layout."""
    template = """{% for m in messages %}
    {% if m.role == 'user' %}
U: {{ m.content }}
    {% else %}
A: {{ m.content }}
    {% endif %}
{% endfor %}"""
    encoder = byte_tokenizer(tmp_path / "model", template)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    _renders_as_transformers(encoder, template, {"messages": messages}, {"conversation": messages})
    assert _decoded(encoder, encoder.encode_chat(messages)) == "U: Hi\nA: Hello\n"


def test_a_template_sees_the_tokenizers_special_tokens(tmp_path: Path) -> None:
    """transformers passes the tokenizer's special tokens to the template (from ``tokenizer_config.json``, a token
    written as ``{"content": ...}`` in older files); a template writes them around the messages."""
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}{{ pad_token }}{{ unk_token }}"
    )
    folder = tmp_path / "model"
    byte_tokenizer(folder, template)
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config = {**specials, "unk_token": {"content": "<unk>", "special": True}, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    encoder = PromptEncoder(folder)
    messages = [{"role": "user", "content": "Hi"}]
    _renders_as_transformers(encoder, template, {"messages": messages}, {"conversation": messages, **specials})
    assert _decoded(encoder, encoder.encode_chat(messages)) == "<s>Hi</s><pad><unk>"


def test_continuing_a_string_final_message_with_a_template_that_loops_over_content(tmp_path: Path) -> None:
    """For such a template vLLM passes even a string content as one text part, and transformers continues that
    part (was refused: the continuation took only a string)."""
    encoder = byte_tokenizer(tmp_path / "model", EVERY_PART_TEMPLATE)
    body = {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}],
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    expected = {"conversation": [{"role": "user", "content": [{"type": "text", "text": "Count"}]},
                                 {"role": "assistant", "content": [{"type": "text", "text": "one, two,"}]}],
                "continue_final_message": True}  # fmt: skip
    theirs = transformers_text(EVERY_PART_TEMPLATE, expected)
    assert theirs == "<|user|>Count<|end|><|assistant|>one, two,"
    assert _decoded(encoder, encoder.encode_chat_request(body)) == theirs


def test_strftime_now_reads_the_encoders_injected_clock(tmp_path: Path) -> None:
    """A template that dates its system prompt (Llama 3's ``strftime_now``) renders from the encoder's ``clock``
    (seconds since the epoch, local time as ``datetime.now()``), so a routing test's tokens do not change at midnight;
    a clock that is no callable is refused when the encoder is made."""
    template = "{{ strftime_now('%Y-%m-%d %H:%M') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    byte_tokenizer(tmp_path / "model", template)
    instant = datetime(2024, 7, 26, 13, 5).timestamp()
    encoder = PromptEncoder(tmp_path / "model", clock=lambda: instant)
    assert _decoded(encoder, encoder.encode_chat([{"role": "user", "content": "Hi"}])) == "2024-07-26 13:05Hi"
    with pytest.raises(InvalidTypeError, match="^PromptEncoder clock must be a callable"):
        PromptEncoder(tmp_path / "model", clock=instant)  # type: ignore[arg-type]
