"""``prefixroute proxy`` called through the official ``openai`` client, as an application calls it.

The first tests are the client's everyday calls (chat and completions, streamed or not, ``models.list()``, and the
exception class each error status maps to); the rest each failed before its fix (found by a contract probe).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from prefixroute import Candidate, LoadPolicy, Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import running_engines, wait_until

CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi"},
]


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(2, max_tokens=3)


@pytest.fixture
def proxy(engines: list[OpenAIEngine]) -> Iterator[Proxy]:
    with Proxy(Router(), [engine.url for engine in engines]) as running:
        yield running
    for engine in engines:
        engine.resume()


def client(proxy: Proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def idle(proxy: Proxy) -> bool:
    wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
    for candidate in proxy.router.decide([7] * 64, proxy.backends).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)
    return True


def test_chat_and_completions(proxy: Proxy) -> None:
    with client(proxy) as openai_client:
        raw = openai_client.chat.completions.with_raw_response.create(model="fake-model", messages=CHAT)
        assert raw.headers["x-prefixroute-backend"] in proxy.backends
        chat = raw.parse()
        assert chat.object == "chat.completion" and chat.choices[0].message.content == " t0 t1 t2"
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        for prompt in ("hello world", [1, 2, 3]):
            completion = openai_client.completions.create(model="fake-model", prompt=prompt)
            assert completion.choices[0].text == " t0 t1 t2"
        assert [model.id for model in openai_client.models.list()] == ["fake-model"]
    assert idle(proxy) and proxy.stats().ok == 3


def test_a_streamed_chat_ends_in_usage_then_done(proxy: Proxy) -> None:
    with client(proxy) as openai_client:
        stream = openai_client.chat.completions.create(
            model="fake-model",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert [c.choices[0].delta.content for c in chunks[:-1]] == ["", " t0", " t1", " t2"]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        with openai_client.chat.completions.with_streaming_response.create(
            model="fake-model",
            messages=CHAT,
            stream=True,
        ) as raw:
            assert raw.headers["content-type"].startswith("text/event-stream")
            events = [line for line in raw.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert idle(proxy)
    wait_until(lambda: proxy.stats().ok == 2, what="both streams counted")


def test_an_async_client_that_leaves_a_stream_releases_it(proxy: Proxy, engines: list[OpenAIEngine]) -> None:
    async def leave_after_the_first_token() -> str | None:
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) as async_client:
            stream = await async_client.completions.create(model="fake-model", prompt=[5, 6, 7], stream=True)
            async for chunk in stream:
                await stream.close()
                return chunk.choices[0].text
        return None

    for engine in engines:
        engine.stall(after_tokens=1)
    assert asyncio.run(leave_after_the_first_token()) == " t0"
    assert idle(proxy)
    wait_until(lambda: proxy.stats().client_disconnect == 1, what="the disconnect counted")


def test_error_statuses_raise_the_openai_exception_of_their_class(
    proxy: Proxy, refused_port: Callable[[], int]
) -> None:
    with client(proxy) as openai_client:
        with pytest.raises(openai.BadRequestError) as bad:  # the proxy's own refusal
            openai_client.completions.create(model="fake-model", prompt=[])
        assert bad.value.status_code == 400 and bad.value.type == "BadRequestError"
        with pytest.raises(openai.NotFoundError):  # the engine's, relayed
            openai_client.completions.create(model="no-such-model", prompt="x")
        with pytest.raises(openai.NotFoundError):
            openai_client.get("/embeddings", cast_to=object)
    with Proxy(Router(), [f"http://127.0.0.1:{refused_port()}"], base_models=[]) as down, client(down) as openai_client:
        with pytest.raises(openai.InternalServerError) as unreachable:
            openai_client.chat.completions.create(model="fake-model", messages=CHAT)
        assert unreachable.value.status_code == 502 and unreachable.value.type == "BadGatewayError"
        assert idle(down)
    assert idle(proxy) and proxy.stats().bad_request == 1


def test_a_model_only_some_backends_serve_goes_to_those() -> None:
    # Before: /v1/models listed every backend's models, but each request routed among all backends, so about half
    # the requests for a model (or a LoRA adapter) that one backend serves were answered 404 by another.
    with (
        OpenAIEngine(model="model-a", max_tokens=1) as a,
        OpenAIEngine(model="model-b", lora_adapters=["adapter-b"], max_tokens=1) as b,
        Proxy(Router(), [a.url, b.url]) as proxy,
        client(proxy) as openai_client,
    ):
        assert sorted(model.id for model in openai_client.models.list()) == ["adapter-b", "model-a", "model-b"]
        for model, engine in [("model-a", a), ("model-b", b), ("adapter-b", b)]:
            for i in range(6):
                raw = openai_client.completions.with_raw_response.create(model=model, prompt=f"question {i}")
                assert raw.headers["x-prefixroute-backend"] == engine.url, (model, i)
        assert idle(proxy) and proxy.stats().ok == 18


def test_a_backend_that_has_not_listed_its_models_still_serves_them() -> None:
    with OpenAIEngine(max_tokens=1) as first, OpenAIEngine(max_tokens=1) as late:
        late.refuse()  # down while the proxy learns the models: it lists none
        with Proxy(Router(), [first.url, late.url]) as proxy, client(proxy) as openai_client:
            late.accept()
            first.refuse()
            raw = openai_client.completions.with_raw_response.create(model="fake-model", prompt="hello")
            assert raw.headers["x-prefixroute-backend"] == late.url  # chosen, or retried there: not a 502
            assert idle(proxy)


class FailsOnOne(LoadPolicy):
    """A policy with a bug that only the retry reaches: it fails when given a single candidate."""

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) < 2:
            raise IndexError("expected two candidates")
        return candidates[0]


def test_a_policy_that_fails_on_the_retry_is_a_json_500_and_the_proxys_fault(refused_port: Callable[[], int]) -> None:
    # Before: aiohttp's plain-text "500 Internal Server Error", counted as the client's disconnect.
    dead = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    with Proxy(Router(policy=FailsOnOne()), dead, base_models=[]) as proxy, client(proxy) as openai_client:
        with pytest.raises(openai.InternalServerError) as failed:
            openai_client.completions.create(model="fake-model", prompt="x")
        assert failed.value.status_code == 500 and failed.value.type == "InternalServerError"
        assert "policy" in failed.value.message
        stats = proxy.stats()
        assert (stats.internal_error, stats.client_disconnect, stats.retries) == (1, 0, 1)
        assert idle(proxy)
