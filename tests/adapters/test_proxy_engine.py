"""The fake vLLM OpenAI-compatible engine the proxy tests (and the README's demo) run against."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.errors import ConfigurationError, StateError
from prefixroute.testing import FakeVLLM
from prefixroute.testing.openai_engine import OpenAIEngine, render_chat, whitespace_tokens
from prefixroute.vllm.metrics import parse_metrics

from ..conftest import DEADLINE_S, returns, wait_until


@pytest.fixture
def engine() -> Iterator[OpenAIEngine]:
    with OpenAIEngine(block_size=4, num_blocks=64, max_tokens=3) as running:
        yield running


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [block.removeprefix("data: ") for block in text.strip().split("\n\n")]


def cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens an answer's ``usage`` reports served from the cache, read as a vLLM client must: its
    ``prompt_tokens_details`` is null when none were (and absent unless vLLM runs with
    ``--enable-prompt-tokens-details``)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def test_streamed_completion_is_vllm_sse_ending_in_done(engine: OpenAIEngine) -> None:
    body = {"model": "fake-model", "prompt": list(range(10)), "stream": True, "max_tokens": 4,
            "stream_options": {"include_usage": True}}  # fmt: skip
    reply = httpx.post(f"{engine.url}/v1/completions", json=body)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:4]] == [" t0", " t1", " t2", " t3"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["prompt_tokens"] == 10
    wait_until(lambda: engine.stats().running == 0, what="the request to be counted")  # after its last byte
    stats = engine.stats()
    assert (stats.completed, stats.disconnected) == (1, 0)  # a stream read to its end is answered in full


def test_stream_chunks_carry_the_fields_vllm_sends() -> None:
    # vLLM dumps a completion chunk whole (exclude_unset=False: usage null, stop_reason null in every chunk) and a
    # chat chunk without its unset fields (stop_reason only in the finishing chunk); the usage chunk without nulls.
    # Was: chat chunks all carried stop_reason, completion chunks no usage.
    prompt = list(range(9))
    with OpenAIEngine(block_size=4, max_tokens=2, clock=lambda: 1_700_000_000.5) as engine:
        httpx.post(f"{engine.url}/v1/completions", json={"prompt": prompt})  # caches its two full blocks
        options = {"stream": True, "stream_options": {"include_usage": True}}
        streams = {}
        for path, body in (
            ("completions", {"prompt": prompt}),
            ("chat/completions", {"messages": [{"role": "user", "content": "a b c d e f g"}]}),  # 9 tokens
        ):
            reply = httpx.post(f"{engine.url}/v1/{path}", json={**body, **options}, headers={"X-Request-Id": "r"})
            events = sse_events(reply.text)
            assert events[-1] == "[DONE]"
            streams[path] = [json.loads(event) for event in events[:-1]]
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
             "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    head = {"id": "cmpl-r", "object": "text_completion", "created": 1_700_000_000, "model": "fake-model"}
    choice = {"index": 0, "logprobs": None, "stop_reason": None}
    assert streams["completions"] == [
        {**head, "choices": [{**choice, "text": " t0", "finish_reason": None}], "usage": None},
        {**head, "choices": [{**choice, "text": " t1", "finish_reason": "length"}], "usage": None},
        {**head, "choices": [], "usage": usage},
    ]
    head = {**head, "id": "chatcmpl-r", "object": "chat.completion.chunk"}
    choice = {"index": 0, "logprobs": None}
    assert streams["chat/completions"] == [
        {**head, "choices": [{**choice, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**head, "choices": [{**choice, "delta": {"content": " t0"}, "finish_reason": None}]},
        {**head, "choices": [{**choice, "delta": {"content": " t1"}, "finish_reason": "length", "stop_reason": None}]},
        {
            **head,
            "choices": [],
            "usage": {key: value for key, value in usage.items() if key != "prompt_tokens_details"},
        },
    ]


def test_continuous_usage_stats_put_usage_on_every_chunk_as_vllm_does() -> None:
    """With ``stream_options.continuous_usage_stats`` (and ``include_usage``, as vLLM's should_include_usage asks)
    vLLM gives every chunk the usage so far: a completion chunk its own prompt's tokens (null details: the chunk is
    dumped whole), a chat chunk the prompt's, the role chunks none generated; the closing usage chunk is as ever.
    Was: the flag was read and ignored, every chunk's usage null, so a client metering per chunk read nothing."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    with OpenAIEngine(max_tokens=2) as engine:

        def chunks(path: str, body: dict[str, Any], stream_options: dict[str, Any]) -> list[dict[str, Any]]:
            body = {**body, "stream": True, "stream_options": stream_options}
            events = sse_events(httpx.post(f"{engine.url}/v1/{path}", json=body).text)
            assert events[-1] == "[DONE]"
            return [json.loads(event) for event in events[:-1]]

        completion = chunks("completions", {"prompt": ["a b c", "d e"]}, options)  # prompts of 3 and 2 tokens
        chat = chunks("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2}, options)
        asked_no_usage = chunks("completions", {"prompt": "a"}, {"include_usage": False, "continuous_usage_stats": 1})

    def so_far(prompt: int, generated: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    assert [(c["choices"][0]["index"], c["usage"]) for c in completion[:-1]] == [
        (0, {**so_far(3, 1), "prompt_tokens_details": None}), (1, {**so_far(2, 1), "prompt_tokens_details": None}),
        (0, {**so_far(3, 2), "prompt_tokens_details": None}), (1, {**so_far(2, 2), "prompt_tokens_details": None}),
    ]  # fmt: skip
    assert completion[-1]["choices"] == [] and completion[-1]["usage"] == so_far(5, 4)
    # 3 prompt tokens: "<|user|> a" and "<|assistant|>"
    assert [(c["choices"][0]["index"], c["usage"]) for c in chat[:-1]] == [
        (0, so_far(3, 0)), (1, so_far(3, 0)), (0, so_far(3, 1)), (1, so_far(3, 1)), (0, so_far(3, 2)), (1, so_far(3, 2))
    ]  # fmt: skip
    assert chat[-1]["choices"] == [] and chat[-1]["usage"] == so_far(3, 4)
    assert [chunk["usage"] for chunk in asked_no_usage] == [None, None]  # continuous usage needs include_usage


def test_whole_answers_carry_the_fields_vllm_sends() -> None:
    """vLLM's CompletionResponse and ChatCompletionResponse (those of their fields the fake fills): each of the ``n``
    choices numbered, its text, null logprobs, the finish and stop reasons, a completion's prompt_logprobs, a chat
    message's role and its empty tool_calls."""
    with OpenAIEngine(max_tokens=2, clock=lambda: 1_700_000_000.5) as engine:
        headers = {"X-Request-Id": "r"}
        completion = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a b", "n": 2}, headers=headers)
        chat = {"messages": [{"role": "user", "content": "a"}]}
        chatted = httpx.post(f"{engine.url}/v1/chat/completions", json=chat, headers=headers)
    usage = {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6, "prompt_tokens_details": None}
    head = {"created": 1_700_000_000, "model": "fake-model"}
    done = {"logprobs": None, "finish_reason": "length", "stop_reason": None}
    assert completion.json() == {"id": "cmpl-r", "object": "text_completion", **head, "usage": usage, "choices": [
        {"index": index, "text": " t0 t1", "prompt_logprobs": None, **done} for index in (0, 1)]}  # fmt: skip
    message = {"role": "assistant", "content": " t0 t1", "tool_calls": []}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": None}
    assert chatted.json() == {"id": "chatcmpl-r", "object": "chat.completion", **head, "usage": usage,
                              "choices": [{"index": 0, "message": message, **done}]}  # fmt: skip


def test_an_answers_own_id_is_vllms_random_uuid(engine: OpenAIEngine) -> None:
    """With no X-Request-Id nor request_id, vLLM names an answer after random_uuid(), uuid4().hex: 32 hex digits (as
    FakeVLLM does). Was: 16."""
    chat = {"messages": [{"role": "user", "content": "a"}]}
    for path, body, prefix in (("completions", {"prompt": "a"}, "cmpl"), ("chat/completions", chat, "chatcmpl")):
        ids = {httpx.post(f"{engine.url}/v1/{path}", json=body).json()["id"] for _ in range(2)}
        assert len(ids) == 2 and all(re.fullmatch(f"{prefix}-[0-9a-f]{{32}}", one) for one in ids), ids


def test_prompt_tokens_details_are_null_when_nothing_was_cached_as_vllm_reports_them(engine: OpenAIEngine) -> None:
    # vLLM (--enable-prompt-tokens-details) sets usage.prompt_tokens_details only when some prompt tokens came from
    # the cache: null in an answer, left out of a stream's usage chunk (dumped without nulls). Was: always
    # {"cached_tokens": 0}, so code reading usage["prompt_tokens_details"]["cached_tokens"] (the docs' own example
    # did) passed against the fake and raised TypeError against vLLM.
    whole = httpx.post(f"{engine.url}/v1/completions", json={"prompt": list(range(9))}).json()
    assert "prompt_tokens_details" in whole["usage"] and whole["usage"]["prompt_tokens_details"] is None
    body = {"prompt": list(range(100, 109)), "stream": True, "stream_options": {"include_usage": True}}
    chunks = [
        json.loads(event) for event in sse_events(httpx.post(f"{engine.url}/v1/completions", json=body).text)[:-1]
    ]
    assert chunks[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    again = httpx.post(f"{engine.url}/v1/completions", json={"prompt": list(range(9))}).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_chat_stream_starts_with_the_role_and_caches_the_rendered_prompt(engine: OpenAIEngine) -> None:
    messages = [{"role": "system", "content": "a b c d e f g h i"}, {"role": "user", "content": "hi"}]
    body = {"messages": messages, "stream": True}
    first = sse_events(httpx.post(f"{engine.url}/v1/chat/completions", json=body).text)
    chunks = [json.loads(event) for event in first[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages}).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == " t0 t1 t2"
    prompt = len(whitespace_tokens(render_chat(messages)))
    assert whole["usage"]["prompt_tokens"] == prompt
    assert cached_tokens(whole["usage"]) == prompt // 4 * 4


def test_the_prefix_cache_is_per_engine_and_block_level(engine: OpenAIEngine) -> None:
    def cached(prompt: Any, url: str = engine.url) -> int:
        usage = httpx.post(f"{url}/v1/completions", json={"prompt": prompt}).json()["usage"]
        return cached_tokens(usage)

    assert cached(list(range(10))) == 0
    assert cached([*range(10), 99]) == 8  # two full blocks of 4
    assert cached("w x y z") == 0 and cached("w x y z q") == 4  # text: one token per word
    with OpenAIEngine(block_size=4) as other:
        assert cached(list(range(10)), other.url) == 0
    stats = engine.stats()
    assert (stats.requests, stats.completed, stats.running, stats.cached_tokens) == (4, 4, 0, 12)


def test_ttft_grows_with_uncached_tokens() -> None:
    """The fake's time to first token is ``prefill_s`` plus ``prefill_per_token_s`` per uncached prompt token: a
    prompt cached whole computes only its last block (vLLM computes the last token, so at most the blocks before it
    hit), one half cached half as long. Asserted on the engine's own record
    of the prefill it simulated and of the tokens it found cached, not on a wall clock (``warm < cold / 2`` failed on
    a loaded machine, where a request's overhead outgrew the 0.128 s it was compared with); that the prefill is
    slept for real is a lower bound, which no load can break."""
    with OpenAIEngine(prefill_per_token_s=2e-3, max_tokens=1) as engine:

        def cached(prompt: list[int]) -> tuple[int, float]:
            usage = httpx.post(f"{engine.url}/v1/completions", json={"prompt": prompt}).json()["usage"]
            return cached_tokens(usage), engine.stats().simulated_prefill_s

        started = time.perf_counter()
        cold = cached(list(range(64)))
        cold_s = time.perf_counter() - started
        warm = cached(list(range(64)))
        half = cached([*range(32), *range(1000, 1032)])  # two of its four blocks cached
    assert cold[0] == 0 and cold[1] == pytest.approx(64 * 2e-3) and cold_s >= 64 * 2e-3
    assert warm[0] == 48 and warm[1] == pytest.approx((64 + 16) * 2e-3)  # it added its last block's prefill
    assert half[0] == 32 and half[1] == pytest.approx((64 + 16 + 32) * 2e-3)


def test_an_engine_on_an_ipv6_host_gives_a_url_clients_can_use() -> None:
    with OpenAIEngine(host="::1") as engine:
        assert engine.url.startswith("http://[::1]:")  # unbracketed, ::1:PORT is no URL (the proxy refuses it)
        assert httpx.get(f"{engine.url}/health").status_code == 200


def test_metrics_parse_as_vllm_metrics(engine: OpenAIEngine) -> None:
    httpx.post(f"{engine.url}/v1/completions", json={"prompt": list(range(8))})
    httpx.post(f"{engine.url}/v1/completions", json={"prompt": list(range(8))})
    metrics = parse_metrics(httpx.get(f"{engine.url}/metrics").text)
    assert (metrics.running, metrics.waiting, metrics.block_size, metrics.num_gpu_blocks) == (0, 0, 4, 64)
    assert metrics.hit_rate == 0.25  # the second hits its first block of 4: vLLM computes the last token's
    assert httpx.get(f"{engine.url}/health").status_code == 200
    assert httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"] == "fake-model"


def test_metrics_are_vllms_families_of_vllms_types(engine: OpenAIEngine) -> None:
    """What a Prometheus scraper of vLLM reads (vllm/v1/metrics/loggers.py, exposed by prometheus_client): each
    family's name and type, a counter's samples named ``_total``, plain text exposition."""
    httpx.post(f"{engine.url}/v1/completions", json={"prompt": list(range(8))})
    reply = httpx.get(f"{engine.url}/metrics")
    assert reply.headers["content-type"].split(";")[0].strip().lower() == "text/plain"
    families = {family.name: family for family in text_string_to_metric_families(reply.text)}
    assert {name: family.type for name, family in families.items()} == {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:cache_config_info": "gauge"}  # fmt: skip
    samples = {sample.name: sample for family in families.values() for sample in family.samples}
    assert samples["vllm:prefix_cache_queries_total"].value == 8
    exposed = {line.split("{")[0] for line in reply.text.splitlines() if not line.startswith("#")}  # the parser
    assert {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= exposed  # adds _total itself
    assert samples["vllm:kv_cache_usage_perc"].labels == {"engine": "0", "model_name": "fake-model"}
    info = {"block_size": "4", "num_gpu_blocks": "64", "enable_prefix_caching": "True", "engine": "0"}
    assert samples["vllm:cache_config_info"].labels == info  # log_metrics_info adds the engine to the config's
    assert 'le="+Inf"' in reply.text  # the last bucket's bound as prometheus_client writes it (a parser reads "+inf")


def test_fail_next_and_stall_by_default_fail_one_request_with_a_500_and_hold_before_any_token(
    engine: OpenAIEngine,
) -> None:
    engine.fail_next()
    replies = [httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a"}) for _ in range(2)]
    assert [reply.status_code for reply in replies] == [500, 200]
    assert replies[0].json() == {"error": {"message": "injected failure (OpenAIEngine.fail_next)",
                                           "type": "InternalServerError", "param": None, "code": 500}}  # fmt: skip
    for status in (400, 599):  # the bounds of an HTTP error status
        engine.fail_next(1, status=status)
        assert httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a"}).status_code == status
    engine.fail_next(2**31)  # the most it takes
    engine.fail_next(0)
    answered = parse_metrics(engine.metrics_text()).ttft_count
    engine.stall()
    body = {"prompt": list(range(8)), "stream": True}
    with httpx.Client() as client, client.stream("POST", f"{engine.url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200  # the headers come at once; no token until resume()
        wait_until(lambda: engine.stats().running == 1, what="the request to stall")
        assert parse_metrics(engine.metrics_text()).ttft_count == answered  # held before prefill: before any token
        engine.resume()
        assert b'" t0"' in reply.read()


def test_models_lists_vllms_cards_for_the_base_model_and_each_adapter() -> None:
    # vLLM's show_available_models: each card made now, with one ModelPermission, and an adapter's card naming the
    # base model as its parent, without max_model_len. Was: created 0, no permission, the base's max_model_len on
    # an adapter too; the proxy passes the cards on as they came, so its clients saw cards no vLLM sends.
    with OpenAIEngine(model="base", lora_adapters=["sql"], clock=lambda: 1_700_000_000.5) as engine:
        listing = httpx.get(f"{engine.url}/v1/models").json()
    assert listing["object"] == "list"
    base, adapter = listing["data"]
    permission = {"object": "model_permission", "created": 1_700_000_000, "allow_create_engine": False,
                  "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                  "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
    ids = []
    for card in (base, adapter):
        (granted,) = card.pop("permission")
        ids.append(granted.pop("id"))
        assert granted == permission
    assert all(re.fullmatch("modelperm-[0-9a-f]{32}", one) for one in ids) and ids[0] != ids[1]
    card = {"object": "model", "created": 1_700_000_000, "owned_by": "vllm"}
    assert base == {"id": "base", **card, "root": "base", "parent": None, "max_model_len": 1 << 20}
    assert adapter == {"id": "sql", **card, "root": "/adapters/sql", "parent": "base", "max_model_len": None}


def test_metrics_count_each_time_to_first_token_as_vllm_does() -> None:
    # Without vLLM's TTFT histogram, `prefixroute doctor` against fake engines said "no TTFT samples yet" forever.
    with OpenAIEngine(prefill_s=0.03, max_tokens=2) as engine:
        for stream in (False, True, False):
            httpx.post(f"{engine.url}/v1/completions", json={"prompt": list(range(8)), "stream": stream})
        metrics = parse_metrics(httpx.get(f"{engine.url}/metrics").text)
    assert metrics.ttft_count == 3
    bounds = dict(metrics.ttft_buckets)
    assert bounds[0.02] == 0 and bounds[float("inf")] == 3  # each waited its 0.03 s prefill
    assert bounds[2560.0] == 3 and metrics.ttft_sum >= 3 * 0.03  # each counted by its own time, none past every bound
    assert [count for _, count in metrics.ttft_buckets] == sorted(count for _, count in metrics.ttft_buckets)


def test_bad_requests_get_openai_errors(engine: OpenAIEngine) -> None:
    for body, status in (({"prompt": [-1]}, 400), ({"prompt": 3}, 400), ({"model": "other", "prompt": "a"}, 404),
                         ({"prompt": ""}, 400), ({"prompt": [2**32]}, 400),  # past uint32: no token id, no 500
                         ({"prompt": [[1], [2**32]]}, 400), ({"prompt": [2**32 - 1]}, 200)):  # fmt: skip
        reply = httpx.post(f"{engine.url}/v1/completions", json=body)
        assert reply.status_code == status, (body, reply.text)
        assert status == 200 or reply.json()["error"]["code"] == status
    for prompt in (3, [-1], [2**32], ["a", [1]]):  # the message says what a prompt must be
        message = httpx.post(f"{engine.url}/v1/completions", json={"prompt": prompt}).json()["error"]["message"]
        assert message.startswith("'prompt' must be a string, a non-empty list of token ids"), prompt
    for path in ("/v1/completions", "/v1/chat/completions"):  # JSON, but no request: the 400 says what to send
        for raw in (b'[{"prompt": "a"}]', b'"a"', b"null"):
            reply = httpx.post(f"{engine.url}{path}", content=raw, headers={"Content-Type": "application/json"})
            assert reply.status_code == 400, (path, raw)
            assert reply.json()["error"]["message"] == "the request body must be a JSON object", (path, raw)
    for no_prompt in ({}, {"prompt": None}, {"prompt": ""}):  # in vLLM's words
        error = httpx.post(f"{engine.url}/v1/completions", json=no_prompt).json()["error"]
        assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty.", no_prompt
    # vLLM's message types each require a role: a message that is no object, or has none, is its 400 (not a 500,
    # nor a message rendered with a role of None)
    for messages in ("hi", ["hi"], [{"content": "hi"}], [{"role": 5, "content": "hi"}]):
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "BadRequestError", (messages, reply.text)


def test_token_ids_are_read_as_vllms_request_model_reads_them(engine: OpenAIEngine) -> None:
    """pydantic's lax ``list[int]``: ``false``/``true``, ``2.0`` and ``"3"`` are the ids 0, 1, 2 and 3, the same
    prompt as the ints (its blocks are cached from the first request); ``1.5`` and null are no ids."""
    ids = list(range(64))
    lax: list[object] = [False, True, 2.0, "3", *ids[4:]]
    first = httpx.post(f"{engine.url}/v1/completions", json={"prompt": ids, "max_tokens": 1})
    second = httpx.post(f"{engine.url}/v1/completions", json={"prompt": lax, "max_tokens": 1})
    assert first.status_code == second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == 64 and usage["prompt_tokens_details"]["cached_tokens"] >= 48
    # A list that starts with a text is no batch when every item reads as an int: ["0", 1, ...] is ids too.
    third = httpx.post(f"{engine.url}/v1/completions", json={"prompt": ["0", *ids[1:]], "max_tokens": 1})
    assert third.status_code == 200, third.text
    assert third.json()["usage"]["prompt_tokens"] == 64
    for prompt, where in (([1, 1.5], "body.prompt.1"), ([True, None], "body.prompt.1"), ([[1], [2.0, "x"]], None)):
        reply = httpx.post(f"{engine.url}/v1/completions", json={"prompt": prompt})
        assert reply.status_code == 400, prompt
        assert where is None or reply.json()["error"]["param"] == where, reply.text


@pytest.mark.parametrize("model", [5, 1.5, True, ["fake-model"], {"id": "fake-model"}])
def test_a_model_that_is_not_a_string_is_a_400_as_vllm_answers_it(engine: OpenAIEngine, model: object) -> None:
    """vLLM's request model types ``model`` as an optional str (pydantic does not take a number for a str): 400, not
    the 404 of a model it lacks."""
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "a"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ]
    for path, body in bodies:
        reply = httpx.post(f"{engine.url}{path}", json={"model": model, **body})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "Bad Request", reply.text
        assert reply.json()["error"]["param"] == "body.model"
        assert reply.json()["error"]["message"] == f"'model' must be a string, not {type(model).__name__}"


def test_a_tool_call_conversation_is_served_as_vllm_serves_it(engine: OpenAIEngine) -> None:
    """An assistant turn that only calls a tool has a null (or no) content, which vLLM reads as empty: the fake
    answered 400, so a tool-using client failed through the proxy against the fake engines only."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "tool_calls": [call]},
    ]
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(whitespace_tokens(render_chat(messages)))
    assert render_chat(messages[1:2]) == "<|assistant|> \n<|assistant|>"


@pytest.mark.parametrize("parts", [[{"type": "text", "text": 5}], [None], [5], [["hi"]]])
def test_content_parts_vllm_refuses_are_a_400(engine: OpenAIEngine, parts: list[object]) -> None:
    """A text part whose text is not a string, or a part that is neither an object nor a string: the fake rendered
    them as text. (A plain string is a part vLLM takes, and a text part without text one it skips: see below.)"""
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == 400
    image = {"type": "image_url", "image_url": {"url": "x"}}  # not text: no tokens, as a text-only template reads it
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    assert render_chat(messages) == render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "parts",
    [["hello", {"type": "text", "text": "world"}], [{"type": "text", "text": "hello"}, "world"],
     [{"type": "text", "text": "hello"}, {"type": "text"}, "world"],
     ["hello", {"type": "text", "text": None}, {"type": "text", "text": "world"}],
     [{"type": "text"}, {"type": "text", "text": "hello world"}]],
)  # fmt: skip
def test_plain_string_parts_are_text_and_a_text_part_without_text_is_skipped_as_vllm_does(
    engine: OpenAIEngine, parts: list[object]
) -> None:
    """vLLM's content-part union ends in ``str`` and chat_utils' _parse_chat_message_content_part takes a plain
    string as the text it is; a part whose ``type`` is ``"text"`` and whose ``text`` is absent or null parses to no
    content and is skipped (PART_TYPES_TO_SKIP_NONE_CONTENT), not refused. The fake refused both (400), as the
    vLLM this test was first written for did. Each list holds one ordinary text part: a list of a user message with
    none (``["hi"]`` alone) pydantic may bind to openai's own message type, whose parts it checks lazily, when
    chat_utils reads them, and refuses there, which the fake does not reproduce."""
    whole = [{"role": "user", "content": "hello world"}]
    messages = [{"role": "user", "content": parts}]
    assert render_chat(messages) == render_chat(whole)
    for stream in (False, True):
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages, "stream": stream})
        assert reply.status_code == 200, reply.text
    usage = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages}).json()["usage"]
    assert usage["prompt_tokens"] == len(whitespace_tokens(render_chat(whole)))


@pytest.mark.parametrize(
    ("part", "message"),
    [({"text": "hi"}, "Missing 'type' field in multimodal part."),
     ({"type": None, "text": "hi"}, "Missing 'type' field in multimodal part."),
     ({"input_audio": None}, "Missing 'type' field in multimodal part."),
     ({"type": 5, "text": "hi"}, "Invalid 'type' field in multimodal part."),
     ({"type": ["text"], "text": "hi"}, "Invalid 'type' field in multimodal part.")],
)  # fmt: skip
def test_a_content_part_without_a_string_type_is_vllms_400(engine: OpenAIEngine, part: object, message: str) -> None:
    """vLLM's content-part union takes a part without ``type`` (its simple media forms have none), then refuses one
    that is no media either, in chat_utils' words; the fake dropped it and answered 200."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, part]}]
    for stream in (False, True):
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages, "stream": stream})
        assert reply.status_code == 400, reply.text
        assert reply.json() == {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    assert engine.stats().requests == 2 and engine.stats().running == 0


# vLLM's renderers/chat_utils.py (MM_PARSER_MAP and the two types it skips when empty), in its order: sorted
SUPPORTED_PART_TYPES = ("audio_embeds, audio_url, image_embeds, image_pil, image_url, input_audio, input_image, "
                        "input_text, output_text, prompt_embeds, refusal, text, thinking, tool_reference, "
                        "video_embeds, video_url")  # fmt: skip


@pytest.mark.parametrize("kind", ["foo", "video", "file", "input_file", "tool_use", "TEXT", ""])
def test_a_content_part_of_a_type_vllm_does_not_know_is_its_400(engine: OpenAIEngine, kind: str) -> None:
    """chat_utils' _parse_chat_message_content_part raises VLLMValidationError(parameter="type", value=...) for a
    type it has no parser for, which vLLM answers 400 BadRequestError with ``param`` "type" and the error's str()
    as the message (its parameter and value appended). The fake dropped such a part and answered 200 (vLLM before
    that answered NotImplementedError's 501 "Unknown part type"). Chat only: a completion has no content parts."""
    message = (f"Unsupported chat content part type: {kind!r}. Supported types: {SUPPORTED_PART_TYPES}. "
               f"(parameter=type, value={kind})")  # fmt: skip
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": kind, kind: "x"}]}]
    for stream in (False, True):
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages, "stream": stream})
        assert reply.status_code == 400, reply.text
        assert reply.json() == {"error": {"message": message, "type": "BadRequestError", "param": "type", "code": 400}}
    assert engine.stats().running == 0 and engine.stats().prompt_tokens == 0


@pytest.mark.parametrize(
    ("part", "text"),
    [({"type": "input_text", "text": "world"}, "world"), ({"type": "output_text", "text": "world"}, "world"),
     ({"type": "refusal", "refusal": "world"}, "world"), ({"type": "thinking", "thinking": "world"}, "world"),
     ({"type": "tool_reference", "name": "world"}, "world"), ({"type": "refusal"}, ""), ({"type": "thinking"}, ""),
     ({"type": "input_image", "image_url": "x"}, ""), ({"type": "video_embeds", "video_embeds": "x"}, ""),
     ({"type": "prompt_embeds", "data": "x"}, ""), ({"type": "image_url", "image_url": {"url": "x"}}, "")],
)  # fmt: skip
def test_every_content_part_type_vllm_knows_is_served_as_it_renders_it(
    engine: OpenAIEngine, part: dict[str, object], text: str
) -> None:
    """The text types render their text (a refusal its ``refusal``, a thinking part its ``thinking``, a tool
    reference its ``name``) and the media types none, as chat_utils renders them for a text template."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, part]}]
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    assert render_chat(messages) == render_chat([{"role": "user", "content": f"hello {text}".strip()}])


TYPELESS_MEDIA: list[dict[str, object]] = [{"image_url": "data:image/png;base64,AAAA"}, {"image_url": {"url": "x"}},
                                           {"audio_url": "a.wav"}, {"video_url": "v.mp4"},
                                           {"input_audio": {"data": "x"}}]  # fmt: skip


@pytest.mark.parametrize("media", TYPELESS_MEDIA)
def test_vllms_media_parts_without_type_are_served_as_media(engine: OpenAIEngine, media: dict[str, object]) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, media]}]
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    assert render_chat(messages) == render_chat([{"role": "user", "content": "hi"}])  # no text, as an image part


def test_an_empty_role_is_served_as_vllm_serves_it(engine: OpenAIEngine) -> None:
    """vLLM's custom message type takes any string ``role`` (``role: Required[str]``), "" too, and leaves it to the
    chat template; the fake's template renders it, as a template that names roles as they come does."""
    reply = httpx.post(f"{engine.url}/v1/chat/completions", json={"messages": [{"role": "", "content": "hi"}]})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("options", [5, "yes", [], ["include_usage"], True, 0, "", {"include_usage": "maybe"},
                                     {"include_usage": 2}, {"continuous_usage_stats": []}])  # fmt: skip
def test_stream_options_that_are_not_vllms_object_are_a_400(engine: OpenAIEngine, path: str, options: object) -> None:
    """vLLM types ``stream_options`` as an optional StreamOptions (``include_usage`` and ``continuous_usage_stats``
    lax booleans): pydantic refuses anything else with 400, streamed or not. The fake streamed on (or answered the
    "only with stream" 400 for a truthy one only)."""
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    for stream in (True, False):
        reply = httpx.post(f"{engine.url}{path}", json={**prompt, "stream": stream, "stream_options": options})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["type"] == "Bad Request", reply.text  # pydantic's, in vLLM
        only_streamed = "Stream options can only be defined when `stream=True`."  # vLLM's words
        if error["message"] == only_streamed:  # its model validator's VLLMValidationError names the parameter
            assert stream is False and error["param"] == "stream_options"
        else:  # pydantic locates the field
            assert "stream_options" in error["message"] and error["param"].startswith("body.stream_options")
    assert engine.stats().running == 0
    usage = {"include_usage": "yes", "continuous_usage_stats": None}  # lax booleans, as pydantic reads them
    for options, chunks in ((usage, 1), ({}, 1), ({"include_usage": None}, 0), (None, 0)):  # vLLM's default: True
        served = httpx.post(f"{engine.url}{path}", json={**prompt, "stream": True, "stream_options": options})
        usages = served.text.count('"usage":{')  # a completion's token chunks carry "usage":null, as vLLM's do
        assert served.status_code == 200 and usages == chunks, (options, served.text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "content_type", [None, "", "text/plain", "application/x-www-form-urlencoded", "application/vnd.api+json"]
)
def test_a_body_not_labelled_json_is_vllms_400(engine: OpenAIEngine, path: str, content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: only ``application/json`` (any case, any parameters) is read as a body; the
    fake read any body as JSON whatever its Content-Type, so a client that forgot the header passed here only."""
    body = {"prompt": "a"} if "chat" not in path else {"messages": [{"role": "user", "content": "a"}]}
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = httpx.post(f"{engine.url}{path}", content=json.dumps(body).encode(), headers=headers)
    assert reply.status_code == 400 and reply.json()["error"] == {
        "message": "Unsupported Media Type: Only 'application/json' is allowed", "type": "Bad Request",
        "param": None, "code": 400}  # fmt: skip
    for label in ("application/json; charset=utf-8", "APPLICATION/JSON"):
        served = httpx.post(f"{engine.url}{path}", content=json.dumps(body).encode(), headers={"Content-Type": label})
        assert served.status_code == 200, served.text


@pytest.mark.parametrize(
    "raw",
    ["Infinity", "NaN", "1e300", "1048576", "true", "1.5", "0", "-3", '"many"', "[2]", "{}"],
)
def test_a_max_tokens_vllm_refuses_is_a_400_not_a_500_or_an_endless_answer(engine: OpenAIEngine, raw: str) -> None:
    """``Infinity`` was a 500 (int() overflowed); ``1e300`` generated for ever (vLLM refuses more than the context,
    ``max_model_len`` in ``/v1/models``); ``0``, ``true`` and ``{}`` silently meant the default."""
    assert httpx.get(engine.url + "/v1/models").json()["data"][0]["max_model_len"] == 1048576
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    for path, prompt in (("/v1/completions", '"prompt": [1, 2, 3]'), ("/v1/chat/completions", chat)):
        body = f'{{{prompt}, "stream": true, "max_tokens": {raw}}}'
        reply = httpx.post(engine.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=5)
        error = reply.json()["error"]
        # no integer: pydantic's 400 ("Bad Request", located); below 1 or past the context: vLLM's serving code's
        typed = raw in ("1e300", "1048576", "0", "-3")
        assert reply.status_code == 400 and error["type"] == ("BadRequestError" if typed else "Bad Request"), error
        assert typed or error["param"] == "body.max_tokens", error
    assert engine.stats().running == 0


@pytest.mark.parametrize("value", [2, 2.0, "2", None])
def test_max_tokens_reads_as_vllm_reads_it(engine: OpenAIEngine, value: object) -> None:
    reply = httpx.post(f"{engine.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": value})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == (3 if value is None else 2)


def test_a_prompt_that_fills_the_context_is_a_400_without_max_tokens_too(engine: OpenAIEngine) -> None:
    """vLLM generates up to the context's end when ``max_tokens`` is absent, and refuses a prompt with no room left
    (the fake served a 2M-token prompt, after seconds of caching it)."""
    reply = httpx.post(f"{engine.url}/v1/completions", json={"prompt": [1] * 1048576}, timeout=30)
    assert reply.status_code == 400 and "maximum context length is 1048576" in reply.json()["error"]["message"]
    assert engine.stats().running == 0


def test_a_model_is_checked_as_vllms_check_model_checks_it() -> None:
    """vLLM's _check_model: a model it does not serve is a 404 whose ``param`` is "model"; no model, null or ``""``
    (_is_model_supported: no name) is the base model's. Was: ``param`` null, and ``""`` a 404."""
    with OpenAIEngine(model="base", lora_adapters=["sql"], max_tokens=1) as engine:
        for path, body in (("/v1/completions", {"prompt": "a"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):  # fmt: skip
            missing = httpx.post(f"{engine.url}{path}", json={"model": "Base", **body})
            assert missing.status_code == 404 and missing.headers["content-type"].startswith("application/json")
            assert missing.json() == {"error": {"message": "The model `Base` does not exist.", "type": "NotFoundError",
                                                "param": "model", "code": 404}}  # fmt: skip
            for model in ("", None):
                served = httpx.post(f"{engine.url}{path}", json={"model": model, **body})
                assert served.status_code == 200 and served.json()["model"] == "base", (model, served.text)


@pytest.mark.parametrize("fake", [OpenAIEngine, FakeVLLM])
def test_other_methods_and_cors_are_answered_as_vllms_app_answers_them(fake: type[OpenAIEngine | FakeVLLM]) -> None:
    """As FastAPI and Starlette's CORSMiddleware answer, wired as vLLM's build_app wires them (checked on loopback;
    allowed origins, methods and headers "*"): FastAPI adds no HEAD to a GET route, so HEAD /v1/models is a 405 like
    any other method a route does not take, with its Allow; a path no route serves is a 404; a preflight (OPTIONS
    with Origin and Access-Control-Request-Method) is CORSMiddleware's 200 on any path; an answer to a request with
    an Origin carries Access-Control-Allow-Origin: *; /metrics takes every method. Was: FakeVLLM answered HEAD, PUT,
    DELETE, PATCH and OPTIONS with http.server's 501 HTML page, OpenAIEngine with aiohttp's text 404 and 405 and a
    200 to HEAD; neither answered a preflight or added the CORS header."""
    origin = {"Origin": "http://ui.example"}
    with fake() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        for method, path, allow in (("HEAD", "/v1/models", "GET"), ("PUT", "/v1/completions", "POST"),
                                    ("DELETE", "/v1/models", "GET"), ("OPTIONS", "/v1/completions", "POST"),
                                    ("PATCH", "/nothing", None), ("HEAD", "/nothing", None)):  # fmt: skip
            reply = client.request(method, path)
            assert reply.status_code == (404 if allow is None else 405), (method, path)
            assert reply.headers.get("allow") == allow and reply.headers["content-type"] == "application/json"
            body = b'{"detail":"Not Found"}' if allow is None else b'{"detail":"Method Not Allowed"}'
            assert reply.content == (b"" if method == "HEAD" else body), (method, path)
            assert reply.headers["content-length"] == str(len(body))
            assert "access-control-allow-origin" not in reply.headers
        asked = {
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, x-a",
        }
        for path in ("/v1/completions", "/nothing", "/metrics"):
            preflight = client.options(path, headers=asked)
            assert preflight.status_code == 200 and preflight.content == b"OK", path
            assert preflight.headers["content-type"] == "text/plain; charset=utf-8"
            assert {name: value for name, value in preflight.headers.items() if name.startswith("access-control")} == {
                "access-control-allow-origin": "*", "access-control-max-age": "600",
                "access-control-allow-methods": "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT, QUERY",
                "access-control-allow-headers": "content-type, x-a"}  # fmt: skip
        plain = client.options("/v1/completions", headers=origin)  # no Access-Control-Request-Method: no preflight
        assert plain.status_code == 405 and plain.headers["access-control-allow-origin"] == "*"
        answers = (client.get("/v1/models", headers=origin), client.get("/nothing", headers=origin),
                   client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=origin),
                   client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "stream": True},
                               headers=origin))  # fmt: skip
        for answer in answers:
            assert answer.headers["access-control-allow-origin"] == "*", answer.request
        for method in ("GET", "HEAD", "POST", "DELETE"):
            metrics = client.request(method, "/metrics/x" if method == "DELETE" else "/metrics")
            assert metrics.status_code == 200 and metrics.content == (b"" if method == "HEAD" else metrics.content)
            assert method == "HEAD" or "vllm:num_requests_running" in metrics.text, method


def test_a_refusal_is_typed_and_located_as_vllm_types_and_locates_it() -> None:
    """vLLM answers what its request model (pydantic) refuses through FastAPI's RequestValidationError: type "Bad
    Request" and ``param`` the field's location (the JSON error's position in the body, ``body`` for a body that is
    empty or no object or a model validator's ValueError, the first bad item of a prompt); what its serving code
    refuses is create_error_response's "BadRequestError"; a body that is no UTF-8 is FastAPI's own 400. Was: every
    400 "BadRequestError" with a null param (an empty body "body.0", no UTF-8 the decoder's message)."""
    chat = {"messages": [{"role": "user", "content": "a"}]}
    cases: list[tuple[str, bytes, str, str | None]] = [
        ("completions", b'{"prompt": "a",}', "Bad Request", "body.15"),
        ("completions", b"[1]", "Bad Request", "body"),
        ("completions", b"", "Bad Request", "body"),
        ("completions", b'{"prompt": null}', "Bad Request", "body"),
        ("completions", b'{"prompt": 3}', "Bad Request", "body.prompt"),
        ("completions", b'{"prompt": [1, "x"]}', "Bad Request", "body.prompt.1"),
        ("completions", b'{"prompt": "a", "n": "two"}', "Bad Request", "body.n"),
        ("completions", b'{"prompt": "a", "stream": "maybe"}', "Bad Request", "body.stream"),
        ("chat/completions", json.dumps({**chat, "max_completion_tokens": 1.5}).encode(), "Bad Request",
         "body.max_completion_tokens"),
        ("completions", b'{"prompt": [-1]}', "BadRequestError", None),  # a type pydantic takes: vLLM's later 400
        ("completions", b'{"prompt": "a", "n": 0}', "BadRequestError", None),
    ]  # fmt: skip
    label = {"Content-Type": "application/json"}
    unreadable = []
    with OpenAIEngine() as engine:
        for path, raw, kind, param in cases:
            reply = httpx.post(f"{engine.url}/v1/{path}", content=raw, headers=label)
            assert reply.status_code == 400, (raw, reply.text)
            assert (reply.json()["error"]["type"], reply.json()["error"]["param"]) == (kind, param), raw
        unreadable.append(httpx.post(f"{engine.url}/v1/completions", content=b'{"prompt": "\xff"}', headers=label))
    with FakeVLLM() as fake, httpx.Client(base_url=fake.url, timeout=5) as client:
        for raw, kind, param in ((b'{"prompt": [1],}', "Bad Request", "body.15"), (b"[1]", "Bad Request", "body"),
                                 (b"", "Bad Request", "body"),
                                 (b"{}", "Bad Request", "body"), (b'{"prompt": 3}', "Bad Request", "body.prompt"),
                                 (b'{"prompt": [1], "model": 5}', "Bad Request", "body.model"),
                                 (b'{"prompt": [1], "request_id": 5}', "Bad Request", "body.request_id"),
                                 (b'{"prompt": [1], "max_tokens": 1.5}', "Bad Request", "body.max_tokens"),
                                 (b'{"prompt": [-1]}', "BadRequestError", None)):  # fmt: skip
            reply = client.post("/v1/completions", content=raw)
            assert reply.status_code == 400, (raw, reply.text)
            assert (reply.json()["error"]["type"], reply.json()["error"]["param"]) == (kind, param), raw
        unreadable.append(client.post("/v1/completions", content=b'{"prompt": "\xff"}'))
    for reply in unreadable:  # no UTF-8: FastAPI's own 400, which vLLM's error handler does not take
        assert reply.status_code == 400 and reply.json() == {"detail": "There was an error parsing the body"}


def test_answers_are_labelled_and_rendered_as_vllms_responses_are() -> None:
    """vLLM answers JSON with Starlette's JSONResponse (``application/json``, no charset; compact, UTF-8 unescaped)
    and a stream with a StreamingResponse of ``text/event-stream`` (Starlette adds ``; charset=utf-8``; no other
    header), each chunk pydantic's compact JSON. Was: OpenAIEngine's JSON ``application/json; charset=utf-8`` with
    ", " and ": " separators, its stream ``text/event-stream`` with ``Cache-Control: no-cache``; FakeVLLM's JSON
    spaced and escaped."""
    compact = re.compile(rb'"[,:] |\\u')  # a separator with a space, or an escaped character
    with OpenAIEngine(model="модель", max_tokens=2) as engine:
        answers = [httpx.get(f"{engine.url}/v1/models"),
                   httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a"}),
                   httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a", "n": 0}),
                   httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a", "model": "модель-2"})]  # fmt: skip
        streamed = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a", "stream": True})
    with FakeVLLM(model="модель") as fake:
        answers += [httpx.get(f"{fake.url}/v1/models"), httpx.post(f"{fake.url}/v1/completions", json={"prompt": [1]}),
                    httpx.post(f"{fake.url}/v1/completions", json={"prompt": [1], "max_tokens": 0})]  # fmt: skip
    for answer in answers:
        assert answer.headers["content-type"] == "application/json", answer.request
        assert "модель".encode() in answer.content or answer.status_code == 400, answer.request  # not escaped
        assert not compact.search(answer.content), (answer.request, answer.content[:80])
    assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert "cache-control" not in streamed.headers
    assert "модель".encode() in streamed.content and not compact.search(streamed.content)


@pytest.mark.parametrize("fake", [OpenAIEngine, FakeVLLM])
def test_health_is_vllms_empty_200(fake: type[OpenAIEngine | FakeVLLM]) -> None:
    """vLLM's GET /health answers Response(status_code=200): no body, no Content-Type; other methods get FastAPI's
    405. Was: FakeVLLM answered 404."""
    with fake() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.content == b"" and "content-type" not in health.headers
        refused = client.post("/health")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET"


@pytest.mark.parametrize("fake", [OpenAIEngine, FakeVLLM])
@pytest.mark.parametrize(
    ("method", "target", "host", "location"),
    [("POST", "/v1/completions/", None, "/v1/completions"),
     ("POST", "/v1/completions//?a=b&c=%20d", None, "/v1/completions?a=b&c=%20d"),
     ("GET", "/v1/completions/", None, "/v1/completions"),  # a method the route does not take: redirected too
     ("GET", "/v1/models/", "gateway.example:9", "http://gateway.example:9/v1/models"),
     ("HEAD", "/health/", "bad host", "/health"),  # an invalid Host: the address the engine listens at
     ("POST", "/v1/completions/", "[1:2:3]:80", "/v1/completions"),
     ("POST", "/v1/completions%2F", "[::1]:8000", "http://[::1]:8000/v1/completions")],
)  # fmt: skip
def test_a_trailing_slash_is_redirected_as_vllms_app_redirects_it(
    fake: type[OpenAIEngine | FakeVLLM], method: str, target: str, host: str | None, location: str
) -> None:
    """vLLM's FastAPI app (Starlette's ``redirect_slashes``) answers a path that one of its routes serves without
    its trailing slashes with an empty 307 to that path, any method, the query string kept, at the request's Host
    (else the address it listens at); a path no route serves is still a 404. Was: both fakes answered 404."""
    headers = {} if host is None else {"Host": host}
    with fake() as engine, httpx.Client(base_url=engine.url, timeout=5) as client:
        reply = client.request(method, target, json=None if method == "HEAD" else {"prompt": [1, 2]}, headers=headers)
        assert reply.status_code == 307, reply.text
        assert reply.headers["location"] == (engine.url + location if location.startswith("/") else location)
        assert reply.content == b""
        if isinstance(engine, OpenAIEngine):  # its chat route too; nothing was generated
            chat = client.post("/v1/chat/completions/", json={"messages": [{"role": "user", "content": "a"}]})
            assert (chat.status_code, chat.headers["location"]) == (307, engine.url + "/v1/chat/completions")
            assert engine.stats().requests == 0
        followed = client.post("/v1/completions/?x=1", json={"prompt": [5, 6, 7], "max_tokens": 2},
                               follow_redirects=True)  # fmt: skip
        assert followed.status_code == 200 and [r.status_code for r in followed.history] == [307]
        assert followed.url == engine.url + "/v1/completions?x=1"
        assert client.post("/v1/nowhere/", json={"prompt": [1]}).status_code == 404


def test_an_adapters_answer_names_the_adapter_as_vllms_does() -> None:
    with OpenAIEngine(model="base", lora_adapters=["sql"], max_tokens=1) as engine:
        for model in ("sql", "base", None):
            body = {"prompt": [1, 2], **({"model": model} if model else {})}
            assert httpx.post(f"{engine.url}/v1/completions", json=body).json()["model"] == (model or "base")


def test_the_base_model_named_or_not_is_one_cache_and_an_adapter_its_own() -> None:
    """vLLM keys cached blocks by LoRA adapter only: a request naming the base model and one naming no model hit each
    other's blocks; an adapter's prompts are cached apart from them."""
    with OpenAIEngine(model="base", lora_adapters=["sql"], block_size=4, max_tokens=1) as engine:

        def cached(model: str | None) -> int:
            body = {"prompt": list(range(9)), **({"model": model} if model else {})}
            return cached_tokens(httpx.post(f"{engine.url}/v1/completions", json=body).json()["usage"])

        assert [cached(None), cached("base"), cached("sql"), cached("sql"), cached(None)] == [0, 8, 0, 8, 8]


def test_fail_next_fails_exactly_that_many(engine: OpenAIEngine) -> None:
    engine.fail_next(2, status=503)
    statuses = [httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a"}).status_code for _ in range(3)]
    assert statuses == [503, 503, 200] and engine.stats().failed == 2


def test_refuse_and_accept_keep_the_port(engine: OpenAIEngine) -> None:
    url = engine.url
    with httpx.Client() as client:
        assert client.get(f"{url}/health").status_code == 200  # a kept-alive connection
        engine.refuse()
        with pytest.raises(httpx.TransportError):
            client.get(f"{url}/health")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
        engine.accept()
        assert engine.url == url and httpx.get(f"{url}/health").status_code == 200


def test_refuse_drops_a_connection_accepted_the_loop_turn_before() -> None:
    # asyncio gives an accepted connection its transport a loop turn after accepting it; refuse() closed the server
    # in between, which fails that unseen (CPython gh-109564) and left the connection open, neither served nor
    # closed, until the garbage collector found it: a proxy that sent a request on it waited that long.
    request = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n{"prompt": "a"}'

    async def scenario() -> None:
        engine = OpenAIEngine()
        await engine.serve()
        port = int(engine.url.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        try:
            with socket.create_connection(("127.0.0.1", port)) as client:  # the kernel completes it at once
                client.setblocking(False)
                await asyncio.sleep(0)  # the loop's next turn runs this test on, then accepts the connection
                engine.refuse()  # on the engine's loop: it runs the turn after, before the connection's transport
                await loop.sock_sendall(client, request)
                with contextlib.suppress(ConnectionResetError):  # or dropped without a reset: b""
                    assert await asyncio.wait_for(loop.sock_recv(client, 1024), 5) == b""
            assert engine.stats().requests == 0
        finally:
            await engine.aclose()

    asyncio.run(scenario())


def test_stop_drops_a_request_in_progress_at_once_as_a_dead_engine_does() -> None:
    engine = OpenAIEngine(max_tokens=3).start()
    engine.stall(after_tokens=1)
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            httpx.post(f"{engine.url}/v1/completions", json={"prompt": "a", "stream": True}, timeout=600).read()
        except BaseException as exc:  # the dropped connection, checked below
            errors.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    wait_until(lambda: engine.stats().running == 1, what="the request to stall")
    # Was a graceful shutdown: it waited for the stalled request (aiohttp's 60 s; the thread's join gave up after
    # 10 s, the request still held). The stall never ends and the client waits up to 10 minutes, so only stop()
    # dropping the connection can end the request: the guards below detect a hang, they measure no speed.
    returns(engine.stop, what="stop() with a request stalled")
    asking.join(DEADLINE_S)
    assert not asking.is_alive(), "stop() returned with the stalled request's connection still open"
    assert len(errors) == 1 and isinstance(errors[0], httpx.TransportError), errors
    assert not isinstance(errors[0], httpx.TimeoutException), errors


def test_a_stalled_stream_counts_its_client_leaving(engine: OpenAIEngine) -> None:
    engine.stall(after_tokens=1)
    body = {"prompt": list(range(8)), "stream": True}
    with httpx.Client() as client, client.stream("POST", f"{engine.url}/v1/completions", json=body) as reply:
        chunks = reply.iter_raw()  # held: a dropped iterator closes the connection
        first = next(chunks)
        assert b'" t0"' in first
        assert engine.stats().running == 1
    deadline = time.monotonic() + 5
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert (stats.running, stats.disconnected, stats.completed) == (0, 1, 0)
    engine.resume()
    assert httpx.post(f"{engine.url}/v1/completions", json=body).status_code == 200


def test_a_stall_holds_an_answer_that_is_not_streamed_too() -> None:
    """``stall(after_tokens=1)`` holds a request once it has generated one token, streamed or not: a client that
    leaves a held answer is counted as gone, not answered."""
    with OpenAIEngine(max_tokens=3) as engine:
        engine.stall(after_tokens=1)
        body = json.dumps({"prompt": "a b"}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", int(engine.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(head.encode() + body)
            wait_until(lambda: parse_metrics(engine.metrics_text()).ttft_count == 1, what="the first token")
        wait_until(lambda: engine.stats().running == 0, what="the request to end")
        stats = engine.stats()
    assert (stats.disconnected, stats.completed) == (1, 0)


def test_a_client_that_leaves_during_a_streamed_prefill_is_counted_not_logged_as_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with OpenAIEngine(prefill_s=0.3) as engine, httpx.Client() as client:
        body = {"prompt": list(range(8)), "stream": True}
        with client.stream("POST", f"{engine.url}/v1/completions", json=body) as reply:
            assert reply.status_code == 200  # the headers come at once, the first chunk after prefill
        deadline = time.monotonic() + 5
        while engine.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert (stats.running, stats.disconnected, stats.completed) == (0, 1, 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_prefill_is_aborted_at_once_as_vllm_aborts_it(stream: bool) -> None:
    """vLLM (``with_cancellation``, and a StreamingResponse's own disconnect listener) aborts a request as soon as its
    client disconnects, streamed or not: its slot and KV blocks are freed, so ``vllm:num_requests_running`` and
    ``vllm:kv_cache_usage_perc`` drop at once, and it never reaches a first token. Was: the fake held it until its
    prefill had run out (here ten minutes), counted running with its blocks held."""
    body = {"prompt": list(range(64)), "stream": stream}

    async def scenario(engine: OpenAIEngine) -> None:
        async with httpx.AsyncClient(base_url=engine.url, timeout=DEADLINE_S * 60) as client:
            asking = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_until, lambda: engine.stats().running == 1, what="the request to run")
            assert parse_metrics(engine.metrics_text()).kv_usage == 4 / 64
            asking.cancel()  # httpx closes the connection of a request it gives up
            with contextlib.suppress(asyncio.CancelledError):
                await asking
            await asyncio.to_thread(wait_until, lambda: engine.stats().running == 0, what="the request's abort")

    with OpenAIEngine(block_size=16, num_blocks=64, prefill_s=600) as engine:
        asyncio.run(scenario(engine))
        metrics = parse_metrics(engine.metrics_text())
        stats = engine.stats()
    assert (metrics.running, metrics.waiting, metrics.kv_usage, metrics.ttft_count) == (0, 0, 0, 0)
    assert (stats.disconnected, stats.completed) == (1, 0)


def test_a_client_that_leaves_while_queued_is_dropped_from_the_queue_at_once() -> None:
    """A request queued behind ``max_running`` whose client disconnects leaves the queue at once (vLLM aborts a
    waiting request too), never runs and never queries the prefix cache. Was: it stayed in
    ``vllm:num_requests_waiting`` until a slot freed, then ran for nobody."""

    async def scenario(engine: OpenAIEngine) -> None:
        async with httpx.AsyncClient(base_url=engine.url, timeout=DEADLINE_S * 60) as client:
            running = asyncio.create_task(client.post("/v1/completions", json={"prompt": list(range(8))}))
            await asyncio.to_thread(wait_until, lambda: engine.stats().running == 1, what="the first to run")
            queued = asyncio.create_task(client.post("/v1/completions", json={"prompt": list(range(100, 132))}))
            await asyncio.to_thread(wait_until, lambda: engine.stats().waiting == 1, what="the second to queue")
            queued.cancel()
            await asyncio.to_thread(wait_until, lambda: engine.stats().waiting == 0, what="the queued one to leave")
            assert parse_metrics(engine.metrics_text()).waiting == 0 and engine.stats().running == 1
            running.cancel()
            await asyncio.to_thread(wait_until, lambda: engine.stats().running == 0, what="the running one's abort")
            for task in (running, queued):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    with OpenAIEngine(max_running=1, prefill_s=600) as engine:
        asyncio.run(scenario(engine))
        metrics = parse_metrics(engine.metrics_text())
        stats = engine.stats()
    assert (metrics.running, metrics.waiting, metrics.prefix_queries) == (0, 0, 8)  # the second never scheduled
    assert (stats.disconnected, stats.completed, stats.prompt_tokens) == (2, 0, 8)


def test_a_body_over_a_mebibyte_is_served_as_vllm_serves_it(engine: OpenAIEngine) -> None:
    words = [f"{i:04d}" + "x" * 1000 for i in range(2000)]  # 2 MB of text, 2000 tokens (aiohttp's default cap: 1 MiB)
    reply = httpx.post(f"{engine.url}/v1/completions", json={"prompt": " ".join(words), "max_tokens": 1}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 2000


@contextlib.contextmanager
def stalled_posts(engine: OpenAIEngine, count: int) -> Iterator[None]:
    """``count`` completions posted at once to ``engine``, stalled before their first token; resumed and answered
    after the block."""
    engine.stall()
    with httpx.Client(timeout=DEADLINE_S) as client:
        threads = [threading.Thread(target=client.post, args=(f"{engine.url}/v1/completions",),
                                    kwargs={"json": {"prompt": "a b"}}) for _ in range(count)]  # fmt: skip
        for thread in threads:
            thread.start()
        try:
            yield
        finally:  # a failed assertion in the block leaves no request stalled
            engine.resume()
            for thread in threads:
                thread.join()


def test_max_running_queues_the_rest() -> None:
    """Past ``max_running`` requests wait, each counted in ``waiting`` (and ``vllm:num_requests_waiting``) until
    it runs."""
    with OpenAIEngine(max_running=1) as engine:
        with stalled_posts(engine, 3):
            wait_until(lambda: (engine.stats().running, engine.stats().waiting) == (1, 2), what="two to queue")
            assert parse_metrics(engine.metrics_text()).waiting == 2
        stats = engine.stats()
    assert (stats.completed, stats.running, stats.waiting) == (3, 0, 0)


def test_requests_answered_together_are_each_counted() -> None:
    """``stats().running`` and ``vllm:num_requests_running`` (what a router balances on) count every request being
    answered, and ``prompt_tokens`` every admitted request's prompt."""
    with OpenAIEngine() as engine:
        with stalled_posts(engine, 2):
            wait_until(lambda: engine.stats().running == 2, what="both requests to stall")
            assert parse_metrics(engine.metrics_text()).running == 2
        stats = engine.stats()
    assert (stats.running, stats.completed, stats.prompt_tokens) == (0, 2, 4)


def free_port_pair() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` were both free a moment ago (both held while checking)."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            base = int(first.getsockname()[1])
            try:
                second.bind(("127.0.0.1", base + 1))
            except OSError:  # taken (or past 65535): draw another
                continue
            return base


def test_the_command_line_starts_n_engines() -> None:
    for _ in range(3):  # another process may take a port between the check and the engines' bind: draw again
        base = free_port_pair()
        command = [sys.executable, "-m", "prefixroute.testing.openai_engine", "--count", "2", "--base-port", str(base)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        if all(lines):
            break
        assert process.wait(timeout=10) == 2
        assert process.stderr is not None
        assert "address already in use" in process.stderr.read()
    with process:
        try:
            urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
            assert [line.split()[-1] for line in lines] == urls
            reply = httpx.post(f"{urls[1]}/v1/completions", json={"prompt": "hello"})
            assert reply.json()["usage"]["prompt_tokens"] == 1
        finally:
            process.terminate()


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_request_id_names_the_answer_as_vllm_names_it(engine: OpenAIEngine, chat: bool) -> None:
    """vLLM's answer id is ``cmpl-`` (``chatcmpl-``) and ``_base_request_id``: the ``X-Request-Id`` header, else the
    body's ``request_id``, else a random one; the fake always drew its own, so a client (or a proxy) tracing a
    request by its id found another one in the answer."""
    kind = "chatcmpl" if chat else "cmpl"
    path, body = ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat else (
        "completions", {"prompt": "hi"})  # fmt: skip
    url = f"{engine.url}/v1/{path}"
    assert httpx.post(url, json=body, headers={"X-Request-Id": "trace-7"}).json()["id"] == f"{kind}-trace-7"
    both = {**body, "request_id": "in-body"}
    assert httpx.post(url, json=both).json()["id"] == f"{kind}-in-body"
    assert httpx.post(url, json=both, headers={"X-Request-Id": "header"}).json()["id"] == f"{kind}-header"
    streamed = httpx.post(url, json={**body, "stream": True, "n": 2}, headers={"X-Request-Id": "s-1"}).text
    events = [json.loads(event) for event in sse_events(streamed)[:-1]]
    assert len(events) > 2 and {event["id"] for event in events} == {f"{kind}-s-1"}
    drawn = httpx.post(url, json=body).json()["id"]
    assert drawn.startswith(f"{kind}-") and drawn != httpx.post(url, json=body).json()["id"]


@pytest.mark.parametrize("request_id", [5, 1.5, True, None, [], {"id": "x"}])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_request_id_that_is_not_a_string_is_vllms_400(engine: OpenAIEngine, chat: bool, request_id: object) -> None:
    """vLLM's CompletionRequest and ChatCompletionRequest type ``request_id`` as ``str`` (a random one when it is
    absent, not when it is null), so pydantic refuses anything else 400, before an X-Request-Id header could name the
    answer; the fake named the answer with a random id and served it."""
    path, body = ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat else (
        "completions", {"prompt": "hi"})  # fmt: skip
    for headers in ({}, {"X-Request-Id": "trace-7"}):
        for stream in (False, True):
            reply = httpx.post(f"{engine.url}/v1/{path}", json={**body, "request_id": request_id, "stream": stream},
                               headers=headers)  # fmt: skip
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert (error["type"], error["code"], error["param"]) == ("Bad Request", 400, "body.request_id")
            assert error["message"] == f"request_id: Input should be a valid string, not {request_id!r}", error
    assert engine.stats().prompt_tokens == 0
    served = httpx.post(f"{engine.url}/v1/{path}", json={**body, "request_id": ""})  # a string, if empty: taken
    assert served.status_code == 200 and served.json()["id"] == ("chatcmpl-" if chat else "cmpl-")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"lora_adapters": [""]}, ConfigurationError, "lora_adapters must name a model"),
        ({"lora_adapters": ["a", "a"]}, ConfigurationError, "lora_adapters lists 'a' twice"),
        ({"lora_adapters": ["fake-model"]}, ConfigurationError, "names the base model 'fake-model'"),
        ({"model": ""}, ConfigurationError, "model must name a model"),
        ({"model": "\ud800"}, ConfigurationError, "model must name a model"),
        ({"model": 5}, ConfigurationError, "model must be a str"),
        ({"lora_adapters": "sql"}, ConfigurationError, "collection of adapter names"),
        ({"lora_adapters": [5]}, ConfigurationError, "must hold names"),
    ],
)
def test_served_names_are_checked_when_the_engine_is_made(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        OpenAIEngine(**options)
    assert OpenAIEngine(model="m", lora_adapters=("a", "b")).lora_adapters == ("a", "b")


def test_response_ids_and_times_come_from_the_engine_seed_and_clock_not_the_global_rng() -> None:
    """Same seed, same answers: the completion ids are drawn from the engine's own seeded RNG (not the process-wide
    ``random``, which other code would advance and which the engine would advance for them), and ``created`` reads
    the injectable ``clock``."""
    bodies = []
    for _ in range(2):
        with OpenAIEngine(seed=7, max_tokens=2, clock=lambda: 1_700_000_000.5) as engine:
            random.seed(0)
            before = random.getstate()
            for chat in (False, True):
                path, body = ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat else (
                    "completions", {"prompt": "hi"})  # fmt: skip
                answer = httpx.post(f"{engine.url}/v1/{path}", json={"model": "fake-model", **body}).json()
                bodies.append((answer["id"], answer["created"]))
            assert random.getstate() == before
    assert bodies[:2] == bodies[2:] and {created for _, created in bodies} == {1_700_000_000}
    (completion, _), (chat, _) = bodies[:2]
    assert completion.startswith("cmpl-") and chat.startswith("chatcmpl-") and completion[5:] != chat[9:]
    with pytest.raises(TypeError, match="clock"):
        OpenAIEngine(clock=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"token_delay_s": "1"}, ConfigurationError, "token_delay_s must be a finite"),
        ({"prefill_s": None}, ConfigurationError, "prefill_s must be a finite"),
        ({"prefill_per_token_s": float("nan")}, ConfigurationError, "prefill_per_token_s must be a finite"),
        ({"tokenizer": "words"}, TypeError, "tokenizer must be a callable"),
        ({"clock": 5}, TypeError, "clock must be a callable"),
        ({"host": None}, ConfigurationError, "host must be a str"),
    ],
)
def test_engine_options_of_the_wrong_type_are_refused_when_given(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each failed later, or with a builtin error: a str delay compared with 0, a tokenizer called per request."""
    with pytest.raises(error, match=message):
        OpenAIEngine(**options)


def test_a_second_start_of_an_engine_is_refused_and_a_failed_one_can_be_retried() -> None:
    before = set(threading.enumerate())
    engine = OpenAIEngine().start()
    with pytest.raises(StateError, match=r"the engine is serving already: stop it \(stop\(\) or aclose\(\)\) first"):
        engine.start()
    assert httpx.get(engine.url + "/health").status_code == 200
    engine.stop()
    assert set(threading.enumerate()) <= before
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = OpenAIEngine(port=port)
        with pytest.raises(OSError):
            engine.start()
    with engine:  # the port is free now: the failed start left nothing behind
        assert httpx.get(engine.url + "/health").status_code == 200


def test_an_engine_not_started_says_so_in_the_exception_tree() -> None:
    engine = OpenAIEngine()
    for call in (lambda: engine.url, engine.refuse, engine.accept):
        with pytest.raises(StateError, match=r"the engine is not started: call start\(\) \(or await serve\(\)\) first"):
            call()


def test_an_engine_stopped_refuses_its_test_hooks_in_the_exception_tree() -> None:
    """Was: after stop(), refuse() and accept() scheduled their coroutine on the closed loop (RuntimeError: Event loop
    is closed); after aclose(), accept() scheduled a _listen() that failed in a task nobody awaited."""
    engine = OpenAIEngine().start()
    engine.stop()
    for call in (engine.refuse, engine.accept):
        with pytest.raises(StateError, match=r"the engine is not started: call start\(\)"):
            call()

    async def served_then_closed() -> None:
        other = OpenAIEngine()
        await other.serve()
        await other.aclose()
        with pytest.raises(StateError, match="the engine is not started"):
            other.accept()

    asyncio.run(served_then_closed())


def test_the_engine_keeps_no_kv_events_it_never_publishes() -> None:
    """OpenAIEngine publishes no KV events; its cache's were kept, one BlockStored (with its tokens) a new block, so a
    long-running ``prefixroute fake-engines`` grew without bound."""
    engine = OpenAIEngine(model="m").start()
    try:
        for i in range(3):
            body = {"model": "m", "prompt": list(range(100 * i, 100 * i + 64)), "max_tokens": 1}
            assert httpx.post(engine.url + "/v1/completions", json=body).status_code == 200
        assert engine.cache.events == []
    finally:
        engine.stop()
