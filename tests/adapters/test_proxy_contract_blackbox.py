"""``prefixroute proxy`` driven as a client of vLLM's OpenAI server drives it, written from issue 11's contract and
the docs alone: every request form vLLM takes (``prompt`` as text, texts, token ids or lists of them; chat content
as text or text parts; ``n``; ``stream_options.include_usage``) through the ``openai`` package and raw HTTP, vLLM's
404 for an unknown model, hostile bodies, a client's ``X-Request-Id`` naming the answer, ``/v1/models`` merged when
the backends disagree or one is down, every backend down (health, models, metrics), and clients that leave before the
first byte or mid-stream; after each, ``/metrics`` parses strictly and nothing is left
in flight or pending prefill. (The refusals test_http_contract_proxy.py and test_proxy_hostile.py already send are
not repeated here.)"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from prefixroute import Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.cli import main
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import running_engines, wait_until

TOKENS = 3  # each fake engine's answer: " t0 t1 t2"
PROMPTS: list[Any] = ["You are a helpful assistant", ["You are a helpful assistant", "SELECT name"], [5, 6, 7],
                      [[5, 6, 7], [8, 9]]]  # fmt: skip
BATCH = [1, 2, 1, 2]  # how many prompts each of PROMPTS holds
WORDS = [5, 7, 3, 5]  # their tokens as the fakes count them (a word each), all prompts together


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(2, max_tokens=TOKENS)


@pytest.fixture(scope="module")
def proxy(engines: list[OpenAIEngine], model_dir: Path) -> Iterator[Proxy]:
    """The proxy as ``prefixroute proxy --tokenizer MODEL`` runs it."""
    with Proxy(Router(), [engine.url for engine in engines], encoder=PromptEncoder(model_dir)) as running:
        yield running


@pytest.fixture
def client(proxy: Proxy, engines: list[OpenAIEngine]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=10) as opened:
        yield opened
    for engine in engines:
        engine.resume()
    assert_idle(proxy)


def assert_idle(proxy: Proxy) -> None:
    """Nothing in flight, pending prefill or held, by the router's own counts and by ``/metrics`` (parsed strictly)."""
    wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
    for candidate in proxy.router.decide([7] * 64, proxy.backends).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)
    samples = strict_metrics(get(proxy, "/metrics"))
    assert set(samples["prefixroute_router_in_flight"].values()) == {0}


def request(proxy: Proxy, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    """One request over a connection of its own: status, Content-Type and the whole body."""
    connection = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]), timeout=10)
    try:
        connection.request(method, path, body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.getheader("Content-Type", ""), reply.read()
    finally:
        connection.close()


def get(proxy: Proxy, path: str) -> str:
    status, kind, body = request(proxy, "GET", path)
    assert status == 200 and kind.startswith("text/plain")
    return body.decode()


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABELS = r'\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*\}'
_SAMPLE = re.compile(rf"({_NAME})({_LABELS})? (\S+)(?: -?\d+)?")
_TYPE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)")


def strict_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus' text format 0.0.4, checked line by line: each sample after its family's one TYPE line, the
    families not interleaved, no series twice, every value a number. Returns name -> labels -> value."""
    assert text.endswith("\n")
    samples: dict[str, dict[str, float]] = {}
    types: dict[str, str] = {}
    family = ""
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            typed = _TYPE.fullmatch(line)
            assert typed and typed[1] not in types, line
            types[typed[1]] = family = typed[1]
        elif line.startswith("#") or not line:
            assert not line or line.startswith("# HELP "), line
        else:
            sample = _SAMPLE.fullmatch(line)
            assert sample, line
            name, labels, value = sample[1], sample[2] or "", sample[3]
            assert name == family or name.removeprefix(family).lstrip("_") in ("bucket", "sum", "count"), line
            assert labels not in samples.setdefault(name, {}), line
            samples[name][labels] = float(value)
            assert not math.isnan(samples[name][labels]), line
    return samples


# -- every request form, as the openai package sends it ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("form", range(len(PROMPTS)), ids=["text", "texts", "ids", "lists-of-ids"])
def test_every_prompt_form_with_n_is_answered_as_vllm_answers_it(
    client: openai.OpenAI, form: int, stream: bool
) -> None:
    """One choice per prompt and per ``n`` (index prompt * n + i), and usage over all of them, as vLLM answers."""
    n, choices = 2, 2 * BATCH[form]
    if not stream:
        whole = client.completions.create(model="fake-model", prompt=PROMPTS[form], n=n)
        assert sorted(choice.index for choice in whole.choices) == list(range(choices))
        assert {choice.text for choice in whole.choices} == {" t0 t1 t2"}
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (WORDS[form], choices * TOKENS)
        return
    texts: dict[int, str] = {}
    chunks = list(
        client.completions.create(
            model="fake-model", prompt=PROMPTS[form], n=n, stream=True, stream_options={"include_usage": True}
        )
    )
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == dict.fromkeys(range(choices), " t0 t1 t2")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (WORDS[form], choices * TOKENS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("content", ["hi there", [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]])
def test_chat_content_as_text_or_parts_with_n(client: openai.OpenAI, content: Any, stream: bool) -> None:
    messages: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}]
    if not stream:
        whole = client.chat.completions.create(model="fake-model", messages=messages, n=2)
        assert [(c.index, c.message.content) for c in whole.choices] == [(0, " t0 t1 t2"), (1, " t0 t1 t2")]
        assert whole.usage is not None and whole.usage.completion_tokens == 2 * TOKENS
        return
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=messages, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + (chunk.choices[0].delta.content or "")
    assert sorted(roles) == [0, 1] and texts == {0: " t0 t1 t2", 1: " t0 t1 t2"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2 * TOKENS


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": [[5, 6], [7, 8]], "stream": True}),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2}),
     ("/v1/completions", {"prompt": ["a b", "c"], "stream": False})],
)  # fmt: skip
def test_raw_http_gets_vllms_framing(proxy: Proxy, path: str, body: dict[str, Any]) -> None:
    """Over plain HTTP/1.1 (no client library): an SSE stream of ``data: JSON`` events ending in ``[DONE]``, or
    one JSON body, with ``max_tokens`` absent (the engine's default)."""
    status, kind, raw = request(proxy, "POST", path, json.dumps(body).encode())
    assert status == 200, raw
    if body["stream"]:
        assert kind.startswith("text/event-stream")
        events = raw.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        for event in events[:-2]:
            assert event.startswith(b"data: ") and json.loads(event[6:])["choices"], event
    else:
        assert len(json.loads(raw)["choices"]) == 2
    assert_idle(proxy)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_clients_request_id_names_the_engines_answer(client: openai.OpenAI, stream: bool) -> None:
    """``X-Request-Id`` goes on to the engine, which names its answer after it (vLLM: ``chatcmpl-`` + the id)."""
    messages: Any = [{"role": "user", "content": "hi"}]
    headers = {"X-Request-Id": f"client-{stream}"}
    if not stream:
        whole = client.chat.completions.create(model="fake-model", messages=messages, extra_headers=headers)
        assert whole.id == "chatcmpl-client-False"
        return
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages, stream=True,
                                                 extra_headers=headers))  # fmt: skip
    assert chunks and {chunk.id for chunk in chunks} == {"chatcmpl-client-True"}


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_vllms_not_found(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="hello", stream=stream)
    assert missing.value.body == {
        "message": "The model `no-such-model` does not exist.", "type": "NotFoundError", "param": "model", "code": 404
    }  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_prompt_is_vllms_400_before_any_decision(proxy: Proxy, client: openai.OpenAI, stream: bool) -> None:
    # Was: routed (a decision committed) and sent on; the fake engines answered it 200 where vLLM answers 400.
    decisions = proxy.router.stats().decisions
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="fake-model", prompt="", stream=stream)
    assert refused.value.body == {"message": "Either prompt or prompt_embeds must be provided and non-empty.",
                                  "type": "BadRequestError", "param": None, "code": 400}  # fmt: skip
    assert proxy.router.stats().decisions == decisions


# -- hostile bodies ------------------------------------------------------------------------------------------------

HOSTILE: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": [[5, 6], [7, 1.5]]}'),  # a fraction deep in a batch (vLLM takes true, 2.0)
    ("/v1/completions", b'{"prompt": ["a", [5]]}'),  # a batch of mixed kinds
    ("/v1/completions", b'{"prompt": [[5, 6], "a"]}'),  # and led by a list (was routed and sent on)
    ("/v1/completions", b'{"prompt": "a", "model": "\\udfff"}'),  # a lone surrogate outside the prompt
    ("/v1/completions", b'{"\\ud800": 1, "prompt": "a"}'),  # and in a key
    ("/v1/completions", b'{"prompt": "a", "n": 0}'),  # vLLM: n must be at least 1
    ("/v1/completions", b'{"prompt": "a", "n": "two"}'),
    ("/v1/completions", b'{"prompt": [5], "stream": "maybe"}'),
    ("/v1/completions", b'{"prompt": [5], "stream_options": {"include_usage": true}}'),  # vLLM: only with stream
    ("/v1/completions", b'{"prompt": [5], "stream": true, "stream_options": 5}'),  # vLLM: an object or null
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a"}], "stream_options": {"a": 1}, "stream": false}',
    ),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"text": "a"}]}]}'),  # vLLM: no type
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "n": -1}'),
]


@pytest.mark.parametrize(("path", "raw"), HOSTILE, ids=[raw.decode()[:48] for _, raw in HOSTILE])
def test_a_hostile_body_is_an_openai_400_and_leaves_nothing_behind(proxy: Proxy, path: str, raw: bytes) -> None:
    status, _, answer = request(proxy, "POST", path, raw)
    body = json.loads(answer)
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == 400, body
    # vLLM's two 400s: its request model's (pydantic's, "Bad Request") and its serving code's ("BadRequestError")
    assert body["error"]["type"] in ("BadRequestError", "Bad Request") and body["error"]["message"]
    assert_idle(proxy)


@pytest.mark.parametrize("prompt", [["a", [5]], [[5, 6], "a"]])
def test_a_batch_mixing_texts_and_lists_is_refused_before_it_is_routed(proxy: Proxy, prompt: list[object]) -> None:
    # Was routed (a decision committed, its blocks predicted) and sent on, for the engine to refuse.
    decisions = proxy.router.stats().decisions
    status, _, answer = request(proxy, "POST", "/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert status == 400 and "holds strings or lists of token ids" in json.loads(answer)["error"]["message"]
    assert proxy.router.stats().decisions == decisions


# -- /v1/models ----------------------------------------------------------------------------------------------------


def test_models_are_merged_when_the_backends_disagree_and_one_is_down(refused_port: Callable[[], int]) -> None:
    down = f"http://127.0.0.1:{refused_port()}"
    with (
        OpenAIEngine(model="model-a", lora_adapters=["adapter-a"], max_tokens=TOKENS) as a,
        OpenAIEngine(model="model-b", max_tokens=TOKENS) as b,
        OpenAIEngine(model="model-a", seed=1, max_tokens=TOKENS) as a2,
        Proxy(Router(), [down, a.url, b.url, a2.url]) as proxy,
        openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=10) as client,
    ):
        models = {model.id: model for model in client.models.list()}
        assert sorted(models) == ["adapter-a", "model-a", "model-b"]  # each once
        assert models["adapter-a"].model_extra and models["adapter-a"].model_extra["parent"] == "model-a"
        for model in ("model-b", "adapter-a"):
            assert client.completions.create(model=model, prompt="hi").choices[0].text == " t0 t1 t2"
        assert_idle(proxy)


# -- every backend down ---------------------------------------------------------------------------------------------


def test_with_every_backend_down_health_says_so_and_metrics_stay_exposition_text(
    refused_port: Callable[[], int],
) -> None:
    """Without ``--metrics-from-backends`` nothing probes the engines: ``/healthz`` is 200 until requests have failed
    on each backend ``max_failures`` times (the documented behaviour), then 503 in JSON; ``/v1/models`` is a 502 in
    OpenAI's error shape; and after hostile requests of every kind ``/metrics`` still parses strictly."""
    down = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    with Proxy(Router(), down, max_failures=2) as proxy:
        assert request(proxy, "GET", "/healthz")[0] == 200
        hostile = [("POST", "/v1/completions", b'{"prompt": "a", "model": "m\\n\\"x"}'),  # 502: none reachable
                   ("POST", "/v1/completions", b"{}"), ("GET", "/v1/completions", None),
                   ("HEAD", "/v1/chat/completions", None), ("POST", "/v1/%22%0A/../x", b"{}"),
                   ("OPTIONS", "/metrics", None)] * 2  # fmt: skip
        for method, path, body in hostile:
            status, kind, answer = request(proxy, method, path, body)
            assert status in (400, 404, 405, 502), (method, path, status)
            if method != "HEAD":
                assert kind.startswith("application/json") and set(json.loads(answer)["error"]) == {
                    "message", "type", "param", "code"}, answer  # fmt: skip
        status, _, answer = request(proxy, "GET", "/v1/models")
        assert status == 502 and json.loads(answer)["error"]["type"] == "BadGatewayError"
        status, _, answer = request(proxy, "GET", "/healthz")
        assert (status, json.loads(answer)) == (503, {"status": "unavailable", "healthy_backends": []})
        samples = strict_metrics(get(proxy, "/metrics"))
        assert set(samples["prefixroute_proxy_backend_up"].values()) == {0}
        assert samples["prefixroute_proxy_requests_total"]['{outcome="unreachable"}'] == 2
        assert samples["prefixroute_proxy_requests_total"]['{outcome="bad_request"}'] == 2
        assert min(samples["prefixroute_proxy_models_skipped_total"].values()) >= 1  # at start, and each listing


# -- clients that leave --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("after_tokens", [0, 1], ids=["before-the-first-byte", "mid-answer"])
def test_a_client_that_leaves_leaves_nothing_in_flight_or_pending(
    proxy: Proxy, engines: list[OpenAIEngine], stream: bool, after_tokens: int
) -> None:
    for engine in engines:
        engine.stall(after_tokens=after_tokens)
    disconnects = proxy.stats().client_disconnect
    body = json.dumps({"prompt": "the same long prefix " * 20, "n": 2, "stream": stream}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    head += "\r\n\r\n"
    with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])), timeout=10) as raw:
        raw.sendall(head.encode() + body)
        wait_until(lambda: proxy.router.stats().in_flight == 1, what="the request in flight")
        if stream and after_tokens:
            assert raw.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(0.02)
    wait_until(lambda: proxy.stats().client_disconnect == disconnects + 1, what="the disconnect counted")
    wait_until(lambda: sum(engine.stats().running for engine in engines) == 0, what="the engine stopped")
    for engine in engines:
        engine.resume()
    assert_idle(proxy)


# -- the command line ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [[], ["--backends"], ["--backends", "ftp://gpu0"], ["--backends", "http://127.0.0.1:9", "http://127.0.0.1:9"],
     ["--port", "70000"], ["--port", "-1"], ["--policy", "os:system"], ["--policy", "no.such.module:Policy"],
     ["--block-size", "0"], ["--tokenizer", "/dev/null"], ["--tokenizer", "/nonexistent"], ["--base-model"],
     ["--kv-events", "tcp://127.0.0.1:5557"], ["--no-such-option"], ["--max-body-mib", "0"],
     ["--max-body-mib", "-5"], ["--max-body-mib", "1e3"], ["--max-body-mib", "5000"], ["--max-failures", "0"],
     ["--max-failures", "1.5"], ["--cooldown", "0"], ["--cooldown", "nan"], ["--cooldown", "ten"],
     ["--connect-timeout", "-1"], ["--connect-timeout", "inf"], ["--models-timeout", "0"]],
)  # fmt: skip
def test_a_bad_command_line_is_exit_2_and_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    backends = [] if not argv or argv[0] == "--backends" else ["--backends", "http://127.0.0.1:9"]
    assert main(["proxy", *backends, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("prefixroute proxy: error: "), err
    assert "Traceback" not in err
