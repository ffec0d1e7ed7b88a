"""``prefixroute proxy`` as vLLM users run it: model namespaces (LoRA), KV events and engine metrics, chat templates."""

from __future__ import annotations

import argparse
import json
import re
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from prefixroute import ConfigurationError, InvalidPromptError, Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.adapters.proxy.cli import build, register
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.adapters.tokenize import serialise_chat
from prefixroute.testing.fake_vllm import FakeVLLM
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import running_engines, wait_until

WORDS = [f"w{i}" for i in range(200)]


def make_tokenizer(folder: Path, *, chat_template: str | None = None) -> Path:
    """A word-level tokenizer (``w{i}`` is token ``i``; roles are words too) and optionally a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {word: i for i, word in enumerate([*WORDS, "system", "user", "assistant", "[UNK]"])}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return folder


def proxy_from_command_line(*options: str) -> tuple[Proxy, object]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return build(parser.parse_args(["proxy", *options]))


def post(proxy: Proxy, body: dict[str, object], *, chat: bool = False) -> httpx.Response:
    reply = httpx.post(proxy.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply


# -- the model field is the namespace --------------------------------------------------------------------------------


@pytest.fixture
def lora_engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(3, max_tokens=2, lora_adapters=("sql", "chat"))


def test_lora_adapters_named_in_model_never_share_prefixes(lora_engines: list[OpenAIEngine]) -> None:
    prompt = list(range(1000, 1064))
    with Proxy(Router(), [engine.url for engine in lora_engines]) as proxy:
        assert proxy.base_models == {"fake-model"}  # learned from /v1/models: adapters have a parent
        base = post(proxy, {"model": "fake-model", "prompt": prompt})
        again = post(proxy, {"prompt": prompt})  # no model: the base model, as vLLM reads it
        assert again.headers["x-prefixroute-backend"] == base.headers["x-prefixroute-backend"]
        assert again.headers["x-prefixroute-matched-tokens"] == "64"
        sql = post(proxy, {"model": "sql", "prompt": prompt})
        assert sql.headers["x-prefixroute-matched-tokens"] == "0"  # the base model's blocks are not the adapter's
        assert sql.json()["usage"]["prompt_tokens_details"] is None  # nothing cached, as vLLM reports it
        sql_again = post(proxy, {"model": "sql", "prompt": prompt, "stream": True})
        assert sql_again.headers["x-prefixroute-matched-tokens"] == "64"
        assert sql_again.headers["x-prefixroute-backend"] == sql.headers["x-prefixroute-backend"]
        assert post(proxy, {"model": "chat", "prompt": prompt}).headers["x-prefixroute-matched-tokens"] == "0"
        assert proxy.namespace({"model": "sql"}) == "sql"
        assert proxy.namespace({"model": "fake-model"}) is None and proxy.namespace({}) is None
        assert proxy.router.stats().in_flight == 0


def test_base_models_given_or_learned_once_a_backend_answers(lora_engines: list[OpenAIEngine]) -> None:
    urls = [engine.url for engine in lora_engines]
    with Proxy(Router(), urls, base_models=["sql"]) as given:
        assert given.namespace({"model": "sql"}) is None and given.namespace({"model": "fake-model"}) == "fake-model"
    for engine in lora_engines:
        engine.refuse()
    try:
        with Proxy(Router(), urls) as proxy:
            assert proxy.base_models == frozenset()  # nobody answered: every named model keeps to itself
            for engine in lora_engines:
                engine.accept()
            assert post(proxy, {"model": "fake-model", "prompt": [1, 2, 3]}).status_code == 200
            wait_until(lambda: proxy.base_models == {"fake-model"})  # that request asked the backends again
    finally:
        for engine in lora_engines:
            engine.accept()


def test_the_fake_engine_lists_and_caches_its_adapters_apart(lora_engines: list[OpenAIEngine]) -> None:
    url = lora_engines[0].url
    cards = httpx.get(url + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("fake-model", None), ("sql", "fake-model"),
                                                        ("chat", "fake-model")]  # fmt: skip

    def cached(model: str) -> int:
        body = {"model": model, "prompt": list(range(32))}
        usage = httpx.post(url + "/v1/completions", json=body).json()["usage"]
        return int((usage["prompt_tokens_details"] or {}).get("cached_tokens", 0))  # null: none cached

    assert (cached("sql"), cached("sql"), cached("fake-model"), cached("chat")) == (
        0,
        16,
        0,
        0,
    )  # all but the last block
    assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": [1]}).status_code == 404


# -- KV events and engine metrics ------------------------------------------------------------------------------------


@pytest.fixture
def vllm_proxy(tmp_path: Path) -> Iterator[tuple[Proxy, list[FakeVLLM]]]:
    """The command line's proxy with --kv-events and --metrics-from-backends in front of two FakeVLLM engines."""
    engines = [FakeVLLM(seed=i, num_blocks=256).start() for i in range(2)]
    try:
        events = [f"{engine.endpoint},{engine.replay_endpoint}" for engine in engines]
        options = ["--backends", *[e.url for e in engines], "--kv-events", *events, "--metrics-from-backends",
                   "--tokenizer", str(make_tokenizer(tmp_path))]  # fmt: skip
        proxy, fleet = proxy_from_command_line(*options)
        try:
            with proxy:
                yield proxy, engines
        finally:
            fleet.close()  # type: ignore[attr-defined]
    finally:
        for engine in engines:
            engine.stop()


def test_the_router_follows_the_engines_kv_events(vllm_proxy: tuple[Proxy, list[FakeVLLM]]) -> None:
    proxy, engines = vllm_proxy
    urls = list(proxy.backends)
    prompt = list(range(100, 164))  # ids of the model's vocabulary (the proxy refuses others, as vLLM does)
    engines[1].complete(prompt)  # cached on engine 1 by someone else: only its KV events tell the proxy
    wait_until(lambda: proxy.router.decide(prompt, urls).confirmed_tokens == 64)
    reply = post(proxy, {"prompt": [*prompt, 7, 8, 9]})
    assert reply.headers["x-prefixroute-backend"] == urls[1]
    assert reply.headers["x-prefixroute-matched-tokens"] == "64"
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # the engine's own hit
    other = list(range(10, 58))
    engines[0].complete(other)
    wait_until(lambda: proxy.router.decide(other, urls).backend == urls[0])
    engines[0].clear_cache()  # AllBlocksCleared: what engine 0 held is forgotten
    wait_until(lambda: all(c.matched_tokens == 0 for c in proxy.router.decide(other, urls).candidates))
    assert proxy.router.stats().in_flight == 0


def test_engine_metrics_feed_the_policy_and_a_failing_scrape_takes_a_backend_out(
    vllm_proxy: tuple[Proxy, list[FakeVLLM]],
) -> None:
    proxy, engines = vllm_proxy
    urls = list(proxy.backends)
    engines[0].set_load(waiting=7)

    def queue() -> dict[str, int | None]:
        return {c.backend: c.queue_len for c in proxy.router.decide([1] * 32, urls).candidates}

    wait_until(lambda: queue() == {urls[0]: 7, urls[1]: 0})
    prompt = list(range(120, 184))
    engines[0].complete(prompt)
    wait_until(lambda: proxy.router.decide(prompt, urls).backend == urls[0])
    engines[0].set_metrics_fault(text="not prometheus {")
    wait_until(lambda: proxy.healthy_backends() == [urls[1]])
    assert httpx.get(proxy.url + "/healthz").json()["healthy_backends"] == [urls[1]]
    reply = post(proxy, {"prompt": prompt})
    assert reply.headers["x-prefixroute-backend"] == urls[1]  # engine 0 holds the prefix but is out of rotation
    engines[0].set_metrics_fault()
    wait_until(lambda: proxy.healthy_backends() == urls)


# -- the model's chat template ---------------------------------------------------------------------------------------

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def test_chat_routes_on_the_models_chat_template(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path / "model", chat_template=TEMPLATE)
    messages = [{"role": "system", "content": " ".join(WORDS[:70])}, {"role": "user", "content": "w5 w6"}]
    encoder = PromptEncoder(folder)
    templated = encoder.encode_chat(messages)
    assert templated[:2] == [200, 0] and len(templated) == 75  # "system w0 ... user w5 w6 assistant"
    assert encoder.encode(serialise_chat(messages))[0] != templated[0]  # without the template: "<|system|>"
    with OpenAIEngine(max_tokens=2) as engine:
        proxy, _ = proxy_from_command_line("--backends", engine.url, "--tokenizer", str(folder))
        with proxy:
            post(proxy, {"messages": messages}, chat=True)
            reply = post(proxy, {"messages": messages}, chat=True)
            assert reply.headers["x-prefixroute-matched-tokens"] == "64"
            same_ids = post(proxy, {"prompt": [*templated, 1, 2]})  # the engine's own token ids of that chat
            assert same_ids.headers["x-prefixroute-matched-tokens"] == "64"
            bad = httpx.post(proxy.url + "/v1/chat/completions", json={"messages": [{"content": "no role"}]})
            assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
            assert proxy.stats().bad_request == 1 and proxy.router.stats().in_flight == 0


def test_content_parts_render_as_vllm_passes_them_to_a_string_template(tmp_path: Path) -> None:
    encoder = PromptEncoder(make_tokenizer(tmp_path / "model", chat_template=TEMPLATE))
    parts = [{"type": "text", "text": "w1 w2"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text",
             "text": "w3"}]  # fmt: skip
    assert encoder.encode_chat([{"role": "user", "content": parts}]) == encoder.encode_chat(
        [{"role": "user", "content": "w1 w2\nw3"}]
    )
    # No "type" is a text part; a plain string is one too (vLLM's _parse_chat_message_content_part); an audio part's
    # text is not the message's; an empty text is left out, as vLLM keeps only what parses to something.
    untyped = [{"text": "w1"}, "w9", {"type": "input_audio", "text": "w8"}, {"type": "text", "text": ""}, "w2"]
    assert encoder.encode_chat([{"role": "user", "content": untyped}]) == encoder.encode_chat(
        [{"role": "user", "content": "w1\nw9\nw2"}]
    )


def chat_ids(folder: Path) -> list[int]:
    """The token ids of a one-message chat ("w3") as the folder's template renders it (word ``w{i}`` is id ``i``)."""
    return PromptEncoder(folder).encode_chat([{"role": "user", "content": "w3"}])


def test_the_templates_are_found_where_transformers_finds_them(tmp_path: Path) -> None:
    """chat_template.jinja and additional_chat_templates/NAME.jinja, which take priority; else
    tokenizer_config.json's ``chat_template`` (a str, or a list of named templates). The "default" one renders a chat,
    the "tool_use" one (when there is one) a chat with tools, as transformers chooses; a multimodal processor's own
    (processor_config.json's key, else chat_template.json) a chat without tools, as vLLM prefers it. The special
    tokens of the config reach the template as their text ({"content": ...} in older files; any other value is no
    text)."""
    folder = make_tokenizer(tmp_path / "named")
    chat = [{"role": "user", "content": "w3"}]

    def with_tools() -> list[int]:
        return PromptEncoder(folder).encode_chat(chat, tools=[])  # an empty list is tools all the same

    named = [{"name": "tool_use", "template": "w1"}, {"name": "default", "template": "w2 {{ messages[0].content }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert (chat_ids(folder), with_tools()) == ([2, 3], [1])
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))  # no default one
    assert not PromptEncoder(folder).has_chat_template and with_tools() == [1]
    (folder / "chat_template.jinja").write_text("w4 {{ messages[0].content }}")
    assert (chat_ids(folder), with_tools()) == ([4, 3], [4, 3])  # the file, over every template of the config
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("w5")
    assert (chat_ids(folder), with_tools()) == ([4, 3], [5])
    (folder / "chat_template.jinja").unlink()
    (folder / "additional_chat_templates" / "tool_use.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    assert not PromptEncoder(folder).has_chat_template  # a template that is no str is none
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "w8 {{ messages[0].content }}"}))
    assert not PromptEncoder(folder).has_chat_template  # a processor's file, without a processor
    (folder / "preprocessor_config.json").write_text("{}")
    assert chat_ids(folder) == [8, 3]  # the processor's
    specials = {"chat_template": "{{ bos_token }} {{ eos_token }}w6", "bos_token": {"content": "w7"}, "eos_token": 5}
    (folder / "tokenizer_config.json").write_text(json.dumps(specials))
    assert (chat_ids(folder), with_tools()) == ([8, 3], [7, 6])  # vLLM: the processor's first, unless with tools
    (folder / "processor_config.json").write_text(json.dumps({"chat_template": "w9"}))
    assert chat_ids(folder) == [9]  # its config's key over chat_template.json
    for name in ("chat_template.json", "preprocessor_config.json", "processor_config.json"):
        (folder / name).unlink()
    assert chat_ids(folder) == [7, 6]
    # transformers' special_tokens_map: the seven named tokens, from special_tokens_map.json where the config has
    # none; one without a text is undefined.
    template = "{% if eos_token is defined %}w9{% endif %}{{ bos_token }} {{ sep_token }} {{ mask_token }}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "w1"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "w2", "sep_token": {"content": "w3"},
                                                                "mask_token": "w4"}))  # fmt: skip
    assert chat_ids(folder) == [1, 3, 4]


def test_a_text_gets_the_tokenizers_special_tokens_and_a_chat_only_those_its_template_writes(tmp_path: Path) -> None:
    """The module docstring: a chat's rendered text is tokenized without adding special tokens (the template writes
    them); a text prompt gets those the tokenizer defines. Added tokens count in vocab_size and max_token_id."""
    from tokenizers import Tokenizer, processors

    folder = make_tokenizer(tmp_path / "model")  # ids 0 to 203
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 204)])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": "{{ bos_token }} {{ messages[0].content }}", "bos_token": "<s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    encoder = PromptEncoder(folder)
    assert (encoder.vocab_size, encoder.max_token_id) == (205, 204)
    assert encoder.encode("w1") == [204, 1]
    assert chat_ids(folder) == [204, 3]


def test_the_sandbox_bounds_repetition_only_not_arithmetic(tmp_path: Path) -> None:
    """Up to the limits, not past them: a sequence repeated to exactly 64 Mi characters, a power of exactly 4096."""
    folder = make_tokenizer(
        tmp_path / "model", chat_template="w{{ 3 * 4 }} {{ (['w1'] * 2 + 2 * ['w2']) | join(' ') }}"
    )
    assert chat_ids(folder) == [12, 1, 1, 2, 2]
    limits = "w{{ ('x' * 67108864) | length - 67108859 }} {{ 'w6' if 2 ** 4096 > 2 ** -4096 else 'w0' }}"
    limits += " w{{ ('x' * 67108863 + 'x') | length - 67108857 }} w{{ ('x' * 67108863 ~ 'x') | length - 67108856 }}"
    limits += (
        " w{{ ((2 ** 4096) ** 15 * 2 ** 4094).bit_length() - 65526 }} w{{ ((2 ** 15) ** 4096).bit_length() - 61431 }}"
    )
    assert chat_ids(make_tokenizer(tmp_path / "limits", chat_template=limits)) == [5, 6, 7, 8, 9, 10]


def test_an_output_of_exactly_the_limit_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output bound counts every character once: an output of exactly the limit renders, one more is refused
    (the limit made 100 here: at 64 Mi characters the tokenizer alone takes 3 GB)."""
    from prefixroute.adapters.serve import text

    monkeypatch.setattr(text, "_MAX_TEMPLATE_CHARS", 100)
    assert chat_ids(make_tokenizer(tmp_path / "full", chat_template="{{ ' ' * 48 }}{{ ' ' * 50 }}w1")) == [1]
    over = PromptEncoder(make_tokenizer(tmp_path / "over", chat_template="{{ ' ' * 49 }}{{ ' ' * 50 }}w1"))
    with pytest.raises(InvalidPromptError, match="the chat template's output is over 100 characters"):
        over.encode_chat([{"role": "user", "content": "w3"}])


def test_the_template_renders_as_transformers_renders_chat_templates(tmp_path: Path) -> None:
    """vLLM renders a chat with transformers' apply_chat_template: blocks trimmed and left-stripped, the special tokens
    of tokenizer_config.json, raise_exception() and a tojson that keeps non-ASCII text and takes an indent."""
    folder = make_tokenizer(tmp_path / "model")
    config = {"bos_token": "w1", "eos_token": "w2", "pad_token": "w3", "unk_token": "w4"}
    template = (
        "{% if true %}w{% endif %}\n  {% if true %}5{% endif %} {{ bos_token }} {{ eos_token }} {{ pad_token }} "
        "{{ unk_token }} {{ 'w6' if messages[0].content | tojson == '\"é\"' else 'w0' }} "
        "{{ 'w7' if ({'a': 1} | tojson(indent=2)).count(' ') == 3 else 'w0' }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **config}))
    encoder = PromptEncoder(folder)
    assert encoder.encode_chat([{"role": "user", "content": "é"}]) == [5, 1, 2, 3, 4, 6, 7]
    with pytest.raises(InvalidPromptError, match="the model's chat template rejected the messages: one message only"):
        encoder.encode_chat([{"role": "user", "content": "w1"}] * 2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(
        ConfigurationError,
        match=f"the chat template in {re.escape(repr(str(folder / 'tokenizer_config.json')))} does not compile",
    ):
        PromptEncoder(folder)


def test_the_template_has_the_tags_globals_and_filters_transformers_gives_it(tmp_path: Path) -> None:
    """transformers' environment, as vLLM renders with it: loop controls and ``{% generation %}`` compile (they were
    refused at load), ``strftime_now()`` is the local time (Llama 3.2 dates its system prompt with it: it was
    undefined, so the sidecar's tokens left the engine's there), ``tools`` and ``documents`` are none (they were
    undefined, which ``is not none``), and ``tojson`` takes transformers' arguments (sort_keys was refused)."""
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}w1 {% endfor %}"
        "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}w{{ i + 2 }} {% endfor %}"
        "{% generation %}w5 {% endgeneration %}"
        "{{ 'w6' if tools is none and documents is none else 'w0' }} "
        "{{ 'w7' if strftime_now('%Y-%m-%d') == messages[0].content else 'w0' }} "
        "{{ 'w8' if {'b': 1, 'a': 'é'} | tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True)"
        ' == \'{"a":"\\\\u00e9","b":1}\' else \'w0\' }} '
        "{{ 'w9' if [1] | tojson(indent=256) == '[\\n' ~ ' ' * 256 ~ '1\\n]'"
        " and {'b': 1, 'a': 2} | tojson == '{\"b\": 1, \"a\": 2}' else 'w0' }}"
    )
    folder = make_tokenizer(tmp_path / "model", chat_template=template)
    today = datetime.now().strftime("%Y-%m-%d")
    assert PromptEncoder(folder).encode_chat([{"role": "user", "content": today}] * 2) == [1, 2, 4, 5, 6, 7, 8, 9]


def test_token_ids_past_the_models_vocabulary_are_vllms_400_before_any_decision(tmp_path: Path) -> None:
    """vLLM answers a prompt holding an id past the larger of its tokenizer's largest id and the model's vocab_size - 1
    with 400 "Token id N is out of vocabulary"; the proxy sent it on after its router had decided and committed. With
    the model's tokenizer it now answers so itself, before routing. The model's config.json counts as vLLM counts it
    (Qwen's model vocabulary is larger than its tokenizer's: the ids in between are served); a batch is checked whole,
    as the engine checks it. Without a tokenizer, ids go on as sent: the engine judges them."""
    folder = make_tokenizer(tmp_path / "model")  # ids 0 to 203
    configs = [(None, 203), ({"vocab_size": 256}, 255), ({"vocab_size": 100}, 203),
               ({"vocab_size": 32000, "text_config": {"vocab_size": 240}}, 239),
               ({"vocab_size": 300, "text_config": {"vocab_size": 0}}, 299),  # text_config gives none: the model's
               ({"vocab_size": 300, "text_config": {"vocab_size": 1}}, 203)]  # fmt: skip
    with OpenAIEngine(max_tokens=2) as engine:
        for config, top in configs:
            if config is not None:
                (folder / "config.json").write_text(json.dumps(config))
            assert PromptEncoder(folder).max_token_id == top
            proxy, _ = proxy_from_command_line("--backends", engine.url, "--tokenizer", str(folder))
            with proxy:
                post(proxy, {"prompt": [1, top]})  # the largest id the engine takes
                for prompt, bad in (([1, top + 1], top + 1), ([[1, 2], [top + 7, 3]], top + 7), ([2**31], 2**31)):
                    reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": prompt}, timeout=10)
                    assert reply.status_code == 400, reply.text
                    error = {"message": f"Token id {bad} is out of vocabulary", "type": "BadRequestError",
                             "param": None, "code": 400}  # fmt: skip
                    assert reply.json() == {"error": error}
                assert proxy.stats().bad_request == 3 and proxy.router.stats().decisions == 1
        assert engine.stats().requests == len(configs)  # none of the refused reached it
        (folder / "config.json").write_text("{not json")
        with pytest.raises(ConfigurationError, match="config.json"):
            PromptEncoder(folder)
        proxy, _ = proxy_from_command_line("--backends", engine.url)
        with proxy:
            post(proxy, {"prompt": [1, 2**31]})


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tokenizer_config.json", b"[1, 2]"),
        ("tokenizer_config.json", b'{"chat_template": ["x", 1]}'),
        ("chat_template.jinja", b"\xff\xfe not utf-8"),
        ("additional_chat_templates/tool_use.jinja", b"\xff\xfe not utf-8"),
        ("additional_chat_templates/tool_use.jinja", b"{% if %}"),
        ("chat_template.json", b'"a str"'),
        ("processor_config.json", b"[1]"),
    ],
)
def test_a_model_folder_with_a_malformed_template_file_is_a_configuration_error(
    tmp_path: Path, name: str, content: bytes
) -> None:
    folder = make_tokenizer(tmp_path / "model")
    (folder / "preprocessor_config.json").write_text("{}")  # a multimodal model's: its processor's files are read
    (folder / name).parent.mkdir(exist_ok=True)
    (folder / name).write_bytes(content)
    with pytest.raises(ConfigurationError, match=name):  # the CLI's one line (exit 2)
        proxy_from_command_line("--backends", "http://127.0.0.1:9", "--tokenizer", str(folder))


def test_a_config_that_is_no_json_object_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    folder = make_tokenizer(tmp_path / "model")
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigurationError, match="tokenizer_config.json' must hold a JSON object, not list"):
        PromptEncoder(folder)


def test_a_runaway_chat_template_is_refused_at_load_or_bounded_when_it_renders(tmp_path: Path) -> None:
    looping = make_tokenizer(tmp_path / "looping")
    # Endless only for what the probe renders (four messages, the generation prompt asked for), as vLLM renders chats.
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    endless = "{% if messages | length == 4 and add_generation_prompt %}" + endless + "{% endif %}"
    (looping / "tokenizer_config.json").write_text(json.dumps({"chat_template": endless}))
    threads = set(threading.enumerate())
    refusals: list[Exception] = []

    def load() -> None:
        try:
            PromptEncoder(looping)  # ten billion steps: refused after the probe's 5 s, not a hang
        except ConfigurationError as exc:
            refusals.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    # The probe runs on a daemon thread named for what it is (a thread dump names it; a stuck one never blocks exit).
    wait_until(lambda: any(t.name == "prefixroute-template-probe" for t in threading.enumerate()), what="the probe")
    assert [t.daemon for t in threading.enumerate() if t.name == "prefixroute-template-probe"] == [True]
    loader.join()
    assert len(refusals) == 1 and "did not render a four-message conversation" in str(refusals[0])
    assert repr(str(looping / "tokenizer_config.json")) in str(refusals[0])
    assert set(threading.enumerate()) <= threads  # the probe was stopped, not left running
    huge = make_tokenizer(tmp_path / "huge")
    (huge / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x' * 10**9 }}"}))
    encoder = PromptEncoder(huge)
    with pytest.raises(ValueError, match="repeats a sequence 1,000,000,000 times"):
        encoder.encode_chat([{"role": "user", "content": "hi"}])
    (huge / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 2 ** 1000000000 }}"}))
    with pytest.raises(ValueError, match="to the power 1,000,000,000"):
        PromptEncoder(huge).encode_chat([{"role": "user", "content": "hi"}])
    (huge / "tokenizer_config.json").write_text(
        json.dumps(
            {
                # Only for a one-message chat: the load's probe (four messages, traced line by line) took seconds
                # over this loop, past its 5 s on a busy machine (a flaky refusal at load).
                "chat_template": "{% if messages | length == 1 %}{% for m in messages %}{% for i in range(99999) %}"
                "{{ m['content'] }}{% endfor %}{% endfor %}{% endif %}"
            }
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="output is over 67,108,864 characters"):
        PromptEncoder(huge).encode_chat([{"role": "user", "content": "x" * 1000}])


@pytest.mark.parametrize(
    ("step", "refusal"),
    [
        ("{% set ns.s = ns.s + ns.s %}", "the chat template adds sequences (+) of over 67,108,864 items"),
        ("{% set ns.s = ns.s ~ ns.s %}", "the chat template joins strings (~) of over 67,108,864 characters"),
        ("{% set ns.n = (ns.n or 3) * (ns.n or 3) %}", "the chat template computes a number of over 65,536 bits"),
        ("{% set ns.n = (ns.n or 3) ** 4096 %}", "the chat template computes a number of over 65,536 bits"),
        ("{% set ns.n = (2 ** 16) ** 4096 %}", "the chat template computes a number of over 65,536 bits"),
        ("{{ [ns.s] | tojson(indent=10 ** 9) }}", "the chat template's tojson takes an indent or separator of at "
                                                  "most 256 characters, not 1,000,000,000"),
        ("{{ [ns.s] | tojson(separators=(',', ' ' * 257)) }}", "the chat template's tojson takes an indent or "
                                                               "separator of at most 256 characters, not 257"),
        ("{{ [ns.s] | tojson(indent=' ' * 257) }}", "the chat template's tojson takes an indent or separator of at "
                                                    "most 256 characters, not 257"),
        ("{{ [ns.s] | tojson(indent=300, separators=(',', ':')) }}", "the chat template's tojson takes an indent or "
                                                                     "separator of at most 256 characters, not 300"),
    ],
)  # fmt: skip
def test_a_template_that_builds_a_huge_value_is_refused_before_it_fills_the_memory(
    tmp_path: Path, step: str, refusal: str
) -> None:
    """A string doubled in a loop with ``+`` or ``~`` writes nothing, so the output bound never saw it: a namespace so
    doubled held 8.9 GB within the 5 s the load's probe gives it (here only a one-message chat runs it, as a request
    would); a tojson indent of 10**9 built gigabytes inside json.dumps, then the probe called it a loop."""
    template = "{% if messages | length == 1 %}{% set ns = namespace(s='x', n=0) %}{% for i in range(40) %}" + step
    folder = make_tokenizer(tmp_path / "model", chat_template=template + "{% endfor %}{% endif %}")
    encoder = PromptEncoder(folder)
    with pytest.raises(
        InvalidPromptError, match=re.escape(f"the model's chat template rejected the messages: {refusal}")
    ):
        encoder.encode_chat([{"role": "user", "content": "w1"}])


def test_a_template_error_without_a_message_is_named_by_its_type(tmp_path: Path) -> None:
    """A template that asks for a petabyte (a width no bound here covers) fails with a MemoryError, whose message is
    empty: the 400 read "the model's chat template rejected the messages: " and nothing after."""
    template = "{% if messages | length == 1 %}{{ 'x' | center(10 ** 15) }}{% endif %}"
    encoder = PromptEncoder(make_tokenizer(tmp_path / "model", chat_template=template))
    with pytest.raises(InvalidPromptError) as refused:
        encoder.encode_chat([{"role": "user", "content": "w1"}])
    assert str(refused.value) == "the model's chat template rejected the messages: MemoryError"


def test_data_parallel_size_subscribes_to_every_ranks_endpoint(tmp_path: Path) -> None:
    """--data-parallel-size N: each --kv-events endpoint is rank 0's, rank r's port is its port + r (as vLLM)."""
    tokenizer = str(make_tokenizer(tmp_path))
    backends = ["http://gpu0:8000", "http://gpu1:8000"]
    events = ["tcp://127.0.0.1:5557,tcp://127.0.0.1:5567", "tcp://127.0.0.1:6557"]
    options = ["--backends", *backends, "--kv-events", *events, "--tokenizer", tokenizer, "--data-parallel-size", "2"]
    _, fleet = proxy_from_command_line(*options)
    try:
        subscribers = [fleet.subscribers(backend) for backend in backends]  # type: ignore[attr-defined]
        ports = [[int(s.endpoint.rsplit(":", 1)[1]) for s in ranks] for ranks in subscribers]
        assert ports == [[5557, 5558], [6557, 6558]]
    finally:
        fleet.close()  # type: ignore[attr-defined]
    with_events = ["--kv-events", events[0], events[1], "--tokenizer", tokenizer]
    for bad, message in (
        (["--data-parallel-size", "2"], "needs --kv-events"),
        ([*with_events, "--data-parallel-size", "0"], r"--data-parallel-size must be an int in \[1, 1024\], not 0"),
        ([*with_events, "--data-parallel-size", "60000"], r"--data-parallel-size must be an int in \[1, 1024\]"),
    ):
        with pytest.raises(ConfigurationError, match=message):
            proxy_from_command_line("--backends", *backends, *bad)
