"""Chat requests render as vLLM's server renders them: checked against transformers' own renderer.

vLLM turns a chat request into a conversation (``parse_chat_messages``: string contents, tool-call arguments parsed,
other keys dropped), dumps its ``tools`` through its request model, and renders with transformers'
``render_jinja_template``. Here each request goes through :meth:`PromptEncoder.encode_chat_request`, and the
conversation vLLM would make of it, written out by hand from vLLM's code, through transformers: the token ids of the
two texts must be the same (a byte-level tokenizer, so equal ids are equal texts).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers.utils.chat_template_utils import render_jinja_template

from prefixroute import InvalidPromptError, Router
from prefixroute.adapters.litellm import PrefixRouteHook
from prefixroute.adapters.serve import Sidecar
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.testing.openai_engine import OpenAIEngine

from .test_proxy_vllm import post, proxy_from_command_line
from .test_serve import BACKENDS, call

# A tool-calling template in the shape of the common ones (tools as JSON in the system turn, calls as JSON objects,
# tool results in their own turns, documents, a thinking switch), written for these tests.
TOOLS_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|system|>{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|end|>
{%- elif messages[0].role == 'system' %}<|system|>{{ messages[0].content }}<|end|>
{%- endif %}
{%- if documents %}<|documents|>{% for d in documents %}[{{ d.title }}] {{ d.text }};{% endfor %}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
<|{{ m.role }}|>
{%- if m.name is defined %}({{ m.name }}){% endif %}
{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{ m.content }}
{%- if m.tool_calls is defined %}{% for call in m.tool_calls %}
<call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</call>
{%- endfor %}{% endif %}
{%- if m.tool_call_id is defined %} [{{ m.tool_call_id }}]{% endif %}<|end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{%- endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# As vLLM 0.33's ChatCompletionToolsParam dumps it: its declared fields only, absent ones null (strict and
# defer_loading only when given; a tool's defer_loading also its function's).
BARE = {"function": {"name": "now", "strict": "yes", "x-note": 1}, "x-tag": 1, "defer_loading": False}
BARE_DUMPED = {
    "type": "function",
    "function": {"name": "now", "description": None, "parameters": None, "strict": True, "defer_loading": False},
    "defer_loading": False,
}
BOS = 256
CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
CALL_PARSED = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}

# (request body, the conversation and options vLLM hands transformers for it)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tools": (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
         "tools": [WEATHER, BARE]},
        {"conversation": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
         "tools": [WEATHER, BARE_DUMPED], "add_generation_prompt": True},
    ),
    "tool calls and results": (
        {"messages": [
            {"role": "user",
             "content": [{"type": "text", "text": "Paris?"}, "and Rome?", {"type": "text", "text": ""}]},
            {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "function": {"name": "now"}}],
             "reasoning": "look it up", "refusal": None, "extra": 1},
            {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": [{"type": "text", "text": "sunny"}]},
            {"role": "assistant", "content": "Sunny.", "tool_calls": []},
            {"role": "user", "content": "thanks", "name": 5},
         ], "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}},
        {"conversation": [
            {"role": "user", "content": "Paris?\nand Rome?"},
            {"thinking": "look it up", "role": "assistant", "content": "",
             "tool_calls": [CALL_PARSED, {**CALL, "function": {"name": "now", "arguments": {}}}],
             "reasoning": "look it up", "reasoning_content": "look it up"},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "thanks"},
         ], "tools": [WEATHER], "add_generation_prompt": True, "enable_thinking": False},
    ),
    "documents, no generation prompt": (
        {"messages": [{"role": "user", "content": "Sum up."}], "add_generation_prompt": False,
         "documents": [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]},
        {"conversation": [{"role": "user", "content": "Sum up."}], "add_generation_prompt": False,
         "documents": [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]},
    ),
    "continue the final message": (
        {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"conversation": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}],
         "add_generation_prompt": False, "continue_final_message": True},
    ),
    "continue a final message with trailing space": (
        {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two, "}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"conversation": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two, "}],
         "add_generation_prompt": False, "continue_final_message": True},
    ),
    "template kwargs: theirs over tools and special tokens, the request's flags over theirs": (
        {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "chat_template_kwargs": {
         "add_generation_prompt": False, "continue_final_message": True, "bos_token": "<BOS>", "tools": [{"raw": 1}],
         "enable_thinking": "auto", "documents": None, "tokenize": True}},
        {"conversation": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
         "bos_token": "<BOS>", "tools": [{"raw": 1}]},
    ),
    "reasoning effort": (
        {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "none"},
        {"conversation": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
         "reasoning_effort": "none", "enable_thinking": False},
    ),
    "reasoning effort beside the kwargs' own switch": (
        {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "high",
         "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"}},
        {"conversation": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
         "reasoning_effort": "high", "enable_thinking": False},
    ),
    "Claude Code's billing header, reasoning under its older name, odd tool-call arguments": (
        {"messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1; cch=9a\nYou are Claude Code."},
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"},
                                           {"type": "text", "text": "Be terse."}]},
            {"role": "user", "content": "Hi", "task": "t1"},
            {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [
                {**CALL, "function": {"name": "f", "arguments": "{not json"}},
                {**CALL, "function": {"name": "g", "arguments": "[1, 2]"}},
                {**CALL, "function": {"name": "h", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "done"},
         ]},
        {"conversation": [
            {"role": "system", "content": "You are Claude Code."},
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi", "task": "t1"},
            {"thinking": "think", "role": "assistant", "content": "", "tool_calls": [
                {**CALL, "function": {"name": "f", "arguments": {}}},
                {**CALL, "function": {"name": "g", "arguments": {}}},
                {**CALL, "function": {"name": "h", "arguments": {"x": 1}}}],
             "reasoning": "think", "reasoning_content": "think"},
            {"role": "tool", "content": "done"},
         ], "add_generation_prompt": True},
    ),
    "developer messages, for a template that never names the role": (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "developer", "content": [{"type": "text", "text": "Use"}, "metric"], "tools": []}]},
        {"conversation": [{"role": "system", "content": "Be brief.\n\nUse\nmetric"}, {"role": "user", "content": "Hi"}],
         "add_generation_prompt": True},
    ),
}  # fmt: skip


def byte_tokenizer(folder: Path, template: str, *, bos: bool = False) -> PromptEncoder:
    """A model folder whose tokenizer maps each byte to one token (so equal ids are equal texts) and ``template``;
    with ``bos``, the tokenizer adds a special token ``<s>`` (id 256) before a text, as Llama's does."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if bos:
        tokenizer.add_special_tokens(["<s>"])
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return PromptEncoder(folder)


def transformers_text(template: str, expected: dict[str, Any]) -> str:
    """What transformers renders for vLLM: ``apply_chat_template`` passes the tokenizer's special tokens, then the
    request's template kwargs over them."""
    options = {"bos_token": "<s>", "eos_token": "</s>", **expected}
    conversation = options.pop("conversation")
    # Annotated as a str, it returns the texts and the assistant-token indices.
    rendered = render_jinja_template([conversation], chat_template=template, **options)[0]
    return str(rendered[0])


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> PromptEncoder:
    return byte_tokenizer(tmp_path_factory.mktemp("model"), TOOLS_TEMPLATE)


@pytest.mark.parametrize("case", list(CASES))
def test_a_chat_request_renders_as_vllm_renders_it_with_transformers(encoder: PromptEncoder, case: str) -> None:
    body, expected = CASES[case]
    before = json.dumps(body)
    ours = encoder.encode_chat_request(body)
    theirs = encoder.encode(transformers_text(TOOLS_TEMPLATE, expected))
    assert ours == theirs, (_decoded(encoder, ours), _decoded(encoder, theirs))
    assert json.dumps(body) == before  # the request is left as it came (vLLM's parsing works on its copy)


def _decoded(encoder: PromptEncoder, ids: list[int]) -> str:
    """The text of byte tokens, for a readable failure."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return decoders.ByteLevel().decode([alphabet[i] for i in ids])


def test_tools_and_options_change_the_prefix_a_request_routes_on(encoder: PromptEncoder) -> None:
    """The point of rendering them: two agents with other tools share no system prompt in the engine's cache, and a
    request with tools is not routed as one without."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    plain = encoder.encode_chat_request({"messages": chat})
    with_tools = encoder.encode_chat_request({"messages": chat, "tools": [WEATHER]})
    other_tools = encoder.encode_chat_request({"messages": chat, "tools": [BARE]})
    assert plain == encoder.encode_chat(chat) != with_tools != other_tools
    assert with_tools == encoder.encode_chat(chat, tools=[WEATHER])  # a dumped tool is what it was, here


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": {"type": "function"}}, "'tools' must be a list of tool objects (or null), not an object"),
        ({"tools": [5]}, 'tools[0] must be an object like {"type": "function", "function": {"name": ...}}'),
        ({"tools": [{"type": "function"}]}, "tools[0] must be an object like"),
        ({"tools": [{**WEATHER, "type": "custom"}]}, 'tools[0].type must be "function", not a string'),
        ({"tools": [WEATHER, {"function": {}}]}, "tools[1].function.name must be a string, not null"),
        ({"tools": [{"function": {"name": "f", "description": 5}}]}, "description must be a string or null, not a"),
        ({"tools": [{"function": {"name": "f", "parameters": []}}]}, "parameters must be an object or null, not an"),
        ({"documents": {"title": "a"}}, "'documents' must be a list of objects (or null)"),
        ({"documents": ["text"]}, "'documents' must be a list of objects (or null)"),
        ({"add_generation_prompt": None}, "'add_generation_prompt' must be true or false, not null"),
        ({"continue_final_message": "maybe"}, "'continue_final_message' must be true or false, not a string"),
        ({"continue_final_message": 2}, "'continue_final_message' must be true or false, not a number"),
        ({"continue_final_message": "yes"}, "Cannot set both `continue_final_message` and `add_generation_prompt`"),
        ({"continue_final_message": True}, "Cannot set both `continue_final_message` and `add_generation_prompt`"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs must be an object, not list"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "Chat template is passed with request, but --trust-req"),
        ({"tools": []}, "`tools` must not be an empty array. Either provide at least one tool or omit the field"),
        ({"tools": [{"function": {"name": "f", "strict": "maybe"}}]}, "tools[0].function.strict must be true, false"),
        ({"tools": [{"function": {"name": "f"}, "defer_loading": 2}]}, "tools[0].defer_loading must be true, false or"),
        ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh"),
        ({"chat_template_kwargs": {"messages": []}}, "the model's chat template rejected the messages: "),
    ],
)  # fmt: skip
def test_a_request_vllm_refuses_is_refused_naming_the_field(
    encoder: PromptEncoder, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidPromptError) as refused:
        encoder.encode_chat_request({"messages": [{"role": "user", "content": "Hi"}], **body})
    assert message in str(refused.value)


def test_flags_are_read_as_vllms_request_model_reads_booleans(encoder: PromptEncoder) -> None:
    """pydantic's lax booleans: 0 and 1, and words such as "no" or "T", in any case; vLLM takes them, so must we."""
    chat = [{"role": "user", "content": "Hi"}]
    without = encoder.encode_chat(chat, add_generation_prompt=False)
    assert without != encoder.encode_chat(chat)
    for value in (False, 0, 0.0, "no", "OFF", "f", "0"):
        assert encoder.encode_chat_request({"messages": chat, "add_generation_prompt": value}) == without, value
    for value in (True, 1, 1.0, "Yes", "on", "T", "1"):
        assert encoder.encode_chat_request({"messages": chat, "add_generation_prompt": value}) != without, value


@pytest.mark.parametrize("how", [lambda e: e.encode_chat_request([]), lambda e: e.encode_chat_request({})])
def test_a_body_that_is_no_object_or_has_no_messages_is_a_type_error(
    encoder: PromptEncoder, how: Callable[[PromptEncoder], object]
) -> None:
    with pytest.raises(TypeError, match="must be"):
        how(encoder)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m['role'] }}{% endfor %}", 'set to "content" but this is not an accepted field'),
        ("{% for m in messages %}{{ m.role }}{% if m.content %}!{% endif %}{% endfor %}", "does not appear in the"),
    ],
)
def test_continuing_a_message_the_template_does_not_write_is_refused(
    tmp_path: Path, template: str, message: str
) -> None:
    """transformers' checks, which vLLM passes on as its 400: the template must read the field continued, and write
    it; both here as transformers raises them."""
    encoder = byte_tokenizer(tmp_path / "model", template)
    chat = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match=message.replace("(", ".")):
        transformers_text(template, {"conversation": chat, "continue_final_message": True})
    with pytest.raises(InvalidPromptError, match=message):
        encoder.encode_chat(chat, add_generation_prompt=False, continue_final_message=True)


def test_without_a_template_the_options_change_nothing(tmp_path: Path) -> None:
    """Messages are serialised role by role then (serialise_chat): the template's options have nowhere to go."""
    byte_tokenizer(tmp_path / "model", "")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # no template
    encoder = PromptEncoder(tmp_path / "model")
    chat = [{"role": "user", "content": "Hi"}]
    assert not encoder.has_chat_template
    options = {"tools": [WEATHER], "documents": [{"title": "a", "text": "b"}], "reasoning_effort": "low"}
    assert encoder.encode_chat_request({"messages": chat, **options}) == encoder.encode_chat(chat)


def test_the_proxy_routes_a_chat_on_its_tools_as_the_engine_computes_it(encoder: PromptEncoder, tmp_path: Path) -> None:
    """The engine's KV blocks of a tool-calling chat are those of its tools-rendered tokens: the proxy routes on the
    same tokens (a completion sending those ids matches all the chat's blocks), not on the messages alone."""
    folder = tmp_path / "model"
    byte_tokenizer(folder, TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "Paris?"}]
    body = {"messages": messages, "tools": [WEATHER]}
    with_tools = encoder.encode_chat_request(body)
    with OpenAIEngine(max_tokens=2) as engine:
        proxy, _ = proxy_from_command_line("--backends", engine.url, "--tokenizer", str(folder), "--block-size", "16")
        with proxy:
            assert post(proxy, body, chat=True).status_code == 200
            full = len(with_tools) // 16 * 16
            assert post(proxy, {"prompt": with_tools}).headers["x-prefixroute-matched-tokens"] == str(full)
            without = encoder.encode_chat(messages)  # what it routed on before tools were rendered
            assert int(post(proxy, {"prompt": without}).headers["x-prefixroute-matched-tokens"]) < 16
            assert proxy.router.stats().in_flight == 0


def test_the_sidecar_routes_an_openai_chat_on_its_tools(encoder: PromptEncoder) -> None:
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS, encoder=encoder)
    messages = [{"role": "user", "content": "Paris?"}]
    body = {"messages": messages, "tools": [WEATHER]}
    answer = call(sidecar, "POST", "/v1/chat/completions", body).json()
    assert answer["prompt_tokens"] == len(encoder.encode_chat_request(body)) > len(encoder.encode_chat(messages))
    refused = call(sidecar, "POST", "/v1/chat/completions", {**body, "tools": [{"type": "custom"}]})
    assert refused.status_code == 400 and "tools[0] must be an object" in refused.json()["error"]


def test_litellm_hands_the_encoder_the_calls_tools_and_vllm_options() -> None:
    """LiteLLM passes tools as a call's own argument and vLLM's fields in ``extra_body``: both reach the encoder."""
    seen: list[dict[str, Any]] = []
    texts: list[tuple[str, bool]] = []

    class Noting:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            texts.append((text, add_special_tokens))
            return [1]

        def encode_chat(self, messages: object) -> list[int]:
            raise AssertionError("encode_chat_request is called instead")

        def encode_chat_request(self, body: dict[str, Any]) -> list[int]:
            seen.append(body)
            return [1, 2, 3]

    hook = PrefixRouteHook(Router(), encoder=Noting())
    messages = [{"role": "user", "content": "hi"}]
    request = {"metadata": {}, "tools": [WEATHER], "temperature": 0, "reasoning_effort": "low",
               "extra_body": {"chat_template_kwargs": {"a": 1}}}  # fmt: skip
    deployments = [{"model_name": "g", "litellm_params": {"model": "hosted_vllm/m"}, "model_info": {"id": "d1"}}]
    asyncio.run(hook.async_filter_deployments("g", deployments, messages, request))
    assert seen == [
        {"messages": messages, "tools": [WEATHER], "chat_template_kwargs": {"a": 1}, "reasoning_effort": "low"}
    ]
    completion = {"metadata": {}, "prompt": "hi", "tools": [WEATHER], "extra_body": {"add_special_tokens": False}}
    asyncio.run(hook.async_filter_deployments("g", deployments, None, completion))
    assert texts == [("hi", False)]  # the tools of a completion are no part of its prompt


# A template that takes OpenAI content parts (as vision models' do): it writes its own placeholder for an image.
PARTS_TEMPLATE = """{% for message in messages %}<|{{ message.role }}|>
{%- if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}
{%- if part.type == 'text' %}{{ part.text }}{% elif part.type == 'image' %}<image>{% endif %}
{%- endfor %}{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_a_template_that_loops_over_content_gets_parts_and_writes_its_media_placeholders(tmp_path: Path) -> None:
    encoder = byte_tokenizer(tmp_path / "model", PARTS_TEMPLATE)
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "x"}}, "plain",
               {"image_url": "y"}, {"type": "text", "text": None}, {"type": "refusal", "refusal": "no"}]  # fmt: skip
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content},
                         {"role": "assistant", "content": None}]}  # fmt: skip
    expected = {"conversation": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image"},
                                     {"type": "text", "text": "plain"}, {"type": "image"},
                                     {"type": "text", "text": "no"}]},
        {"role": "assistant", "content": []},
    ], "add_generation_prompt": True}  # fmt: skip
    ours = encoder.encode_chat_request(body)
    assert ours == encoder.encode(transformers_text(PARTS_TEMPLATE, expected))
    assert "<image>" in _decoded(encoder, ours)


@pytest.mark.parametrize(
    ("template", "parts"),
    [
        ("{% for m in messages %}{% for c in m['content'] %}{{ c }}{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{% for c in m.content | selectattr('type') %}{% endfor %}{% endfor %}", True),
        ("{% set rest = messages[1:] %}{% for m in rest %}{% for c in m.content %}{% endfor %}{% endfor %}", True),
        ("{% set a = messages %}{% set b = a %}{% set a = b %}{% for m in b %}{% for c in m.content %}{% endfor %}"
         "{% endfor %}", True),
        ("{% for m in messages if m.role != 'system' %}{% for c in m.content %}{% endfor %}{% endfor %}", True),
        ("{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}"
         "{{ show(m.content) }}{% endfor %}", True),
        ("{% macro show(x, c=none) %}{% for p in c %}{% endfor %}{% endmacro %}{% for m in messages %}"
         "{{ show(1, c=m['content']) }}{% endfor %}", True),
        ("{% macro show(c) %}{% for p in c %}{% endfor %}{% endmacro %}{{ show(messages) }}", False),
        ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}", True),
        ("{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for p in m.content %}{% endfor %}"
         "{% endfor %}", True),
        ("{% set ns = namespace(rest=[]) %}{% set ns.rest = messages %}{% for m in ns.rest %}{% for p in m.content %}"
         "{% endfor %}{% endfor %}", True),
        # vLLM 0.33 skips a set whose target is no plain name (0.32 gave up on it)
        ("{% if false %}{% set first, rest = messages %}{% endif %}{% for m in messages %}{% for c in m.content %}"
         "{% endfor %}{% endfor %}", True),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
        ("{% for c in messages[0].content %}{{ c }}{% endfor %}", False),
        ("{% for m in messages %}{% if false %}{% for k, v in m.content %}{% endfor %}{% endif %}{% endfor %}", False),
        ("{% for i, m in messages %}{% endfor %}{% for m in messages %}{% for c in m.content %}{% endfor %}"
         "{% endfor %}", False),
        ("{% for m in messages %}{% for c in (m | first).content %}{% endfor %}{% endfor %}", False),
    ],
)  # fmt: skip
def test_a_template_takes_parts_when_vllms_auto_content_format_would_say_openai(
    tmp_path: Path, template: str, parts: bool
) -> None:
    """vLLM's detection: a loop over a message's ``content``, the message from a loop over ``messages`` or a name
    set from it (through filters, tests and slices); a loop target that is no plain name makes it give up."""
    encoder = byte_tokenizer(tmp_path / "model", template + "{{ messages[0].content }}")
    rendered = _decoded(encoder, encoder.encode_chat([{"role": "user", "content": "hi"}]))
    assert rendered.endswith("[{'type': 'text', 'text': 'hi'}]" if parts else "hi"), rendered


def test_route_takes_a_chats_tools_and_options_with_its_messages(encoder: PromptEncoder) -> None:
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS, encoder=encoder)
    messages = [{"role": "user", "content": "Paris?"}]
    body = {"messages": messages, "tools": [WEATHER], "add_generation_prompt": False, "reasoning_effort": "low"}
    answer = call(sidecar, "POST", "/route", body).json()
    assert answer["prompt_tokens"] == len(encoder.encode_chat_request(body))
    assert answer["prompt_tokens"] != len(encoder.encode_chat(messages, add_generation_prompt=False))
    alone = call(sidecar, "POST", "/route", {"prompt": "Paris?", "tools": [WEATHER], "documents": []})
    assert alone.status_code == 400
    assert alone.json()["error"] == "'tools', 'documents' go with 'messages' only: send the chat's messages"
    assert call(sidecar, "POST", "/route", {"messages": messages, "tools": 5}).status_code == 400
    assert call(sidecar, "POST", "/route", {"messages": messages, "tools": [{"type": "custom"}]}).status_code == 400
    assert sidecar.router.stats().in_flight == 1  # only the first was routed


def test_route_takes_null_for_the_chat_options_vllm_takes_null_for(encoder: PromptEncoder) -> None:
    """vLLM's chat request has tools, documents and chat_template_kwargs default to null, and a client may send them
    so; the pick mode routed such a chat, /route refused it (400: "Expected `array`, got `null`"), so a gateway that
    passes the client's fields on sent it unrouted. Null is now absent there, as in the pick mode; with a prompt,
    too (not an option sent without messages)."""
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS, encoder=encoder)
    messages = [{"role": "user", "content": "Paris?"}]
    nulls = {"tools": None, "documents": None, "chat_template_kwargs": None}
    for name, value in nulls.items():
        reply = call(sidecar, "POST", "/route", {"messages": messages, name: value})
        assert reply.status_code == 200, (name, reply.text)
        assert reply.json()["prompt_tokens"] == len(encoder.encode_chat(messages)), name
        pick = call(sidecar, "POST", "/v1/chat/completions", {"messages": messages, name: value})
        assert pick.json()["prompt_tokens"] == reply.json()["prompt_tokens"], name
    prompt = call(sidecar, "POST", "/route", {"prompt": "Paris?", **nulls})
    assert prompt.status_code == 200 and prompt.json()["prompt_tokens"] == len(encoder.encode("Paris?")), prompt.text
    assert call(sidecar, "POST", "/route", {"messages": messages, "add_generation_prompt": None}).status_code == 400


def test_add_special_tokens_is_followed_as_vllm_follows_it(tmp_path: Path) -> None:
    """vLLM's ``add_special_tokens``: true by default for a completion's text, false for a chat's rendered text; a
    client that renders its own template sends false with a completion, or the engine's ids would start with two
    BOS tokens and the proxy's with another block than the engine's."""
    folder = tmp_path / "model"
    encoder = byte_tokenizer(folder, TOOLS_TEMPLATE, bos=True)
    text = "<s><|user|>Count the rows of every table in the schema, then sum them.<|end|>"
    with_bos, without = encoder.encode(text), encoder.encode(text, add_special_tokens=False)
    assert with_bos == [BOS, *without]
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert encoder.encode_chat_request({**chat, "add_special_tokens": True}) == [
        BOS,
        *encoder.encode_chat_request(chat),
    ]
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS, encoder=encoder)
    for flag, ids in ((False, without), ("no", without), (True, with_bos)):
        answer = call(sidecar, "POST", "/v1/completions", {"prompt": text, "add_special_tokens": flag}).json()
        assert answer["prompt_tokens"] == len(ids), flag
    assert call(sidecar, "POST", "/v1/completions", {"prompt": text, "add_special_tokens": None}).status_code == 400
    with OpenAIEngine(max_tokens=2) as engine:
        proxy, _ = proxy_from_command_line("--backends", engine.url, "--tokenizer", str(folder), "--block-size", "16")
        with proxy:
            assert post(proxy, {"prompt": text, "add_special_tokens": False}).status_code == 200
            full = len(without) // 16 * 16
            assert post(proxy, {"prompt": without}).headers["x-prefixroute-matched-tokens"] == str(full)
            assert int(post(proxy, {"prompt": with_bos}).headers["x-prefixroute-matched-tokens"]) == 0
            refused = httpx.post(proxy.url + "/v1/completions", json={"prompt": text, "add_special_tokens": "maybe"})
            assert refused.status_code == 400 and "'add_special_tokens' must be true or false" in refused.text


def test_continuing_a_final_message_of_content_parts_continues_its_last_text(tmp_path: Path) -> None:
    """transformers marks the last part with a text, for a template that takes parts."""
    encoder = byte_tokenizer(tmp_path / "model", PARTS_TEMPLATE)
    parts = [{"type": "text", "text": "one,"}, {"type": "image_url", "image_url": {"url": "x"}}, "two,"]
    body = {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": parts}],
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    expected = {"conversation": [
        {"role": "user", "content": [{"type": "text", "text": "Count"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "one,"}, {"type": "image"},
                                          {"type": "text", "text": "two,"}]},
    ], "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    ours = encoder.encode_chat_request(body)
    assert ours == encoder.encode(transformers_text(PARTS_TEMPLATE, expected))
    assert _decoded(encoder, ours).endswith("<image>two,")
    images_only = {**body, "messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}]}
    with pytest.raises(InvalidPromptError, match="the final message has no text to continue"):
        encoder.encode_chat_request(images_only)


def test_the_sidecar_truncates_as_the_proxy_does(encoder: PromptEncoder) -> None:
    """The OpenAI paths of the sidecar route on the tokens vLLM keeps for ``truncate_prompt_tokens``, text, ids and
    chats alike (the proxy's ``truncated``); the options go with the prompt, not instead of its checks."""
    sidecar = Sidecar(Router(block_size=16), backends=BACKENDS, encoder=encoder)
    chat = {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}
    for path, body in (("/v1/completions", {"prompt": "Count the rows of every table."}),
                       ("/v1/completions", {"prompt": list(range(40))}),
                       ("/v1/chat/completions", chat)):  # fmt: skip
        whole = call(sidecar, "POST", path, body).json()["prompt_tokens"]
        assert whole > 20
        for side in ("left", "right"):
            cut = call(sidecar, "POST", path, {**body, "truncate_prompt_tokens": 20, "truncation_side": side})
            assert cut.json()["prompt_tokens"] == 20, (path, cut.text)
        assert call(sidecar, "POST", path, {**body, "truncate_prompt_tokens": -1}).json()["prompt_tokens"] == whole
    bare = Sidecar(Router(block_size=16), backends=BACKENDS)  # no tokenizer: ids still route, text is a 400
    assert (
        call(bare, "POST", "/v1/completions", {"prompt": [1, 2, 3], "truncate_prompt_tokens": 2}).json()[
            "prompt_tokens"
        ]
        == 2
    )
    assert call(bare, "POST", "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 2}).status_code == 400
    past = call(sidecar, "POST", "/v1/completions", {"prompt": [10**6], "truncate_prompt_tokens": 2})
    assert past.status_code == 400 and "out of vocabulary" in past.json()["error"]
