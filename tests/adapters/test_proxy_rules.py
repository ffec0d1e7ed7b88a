"""``prefixroute proxy``'s documented rules, each pinned on loopback with the fake engines: health and cooldown,
what counts as a backend failure, the error answers' statuses and types, and the /metrics and /healthz bodies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client.parser import text_string_to_metric_families

from prefixroute import Candidate, ConfigurationError, InvalidTypeError, LoadPolicy, RoundRobin, Router, StateError
from prefixroute.adapters.proxy import Proxy
from prefixroute.adapters.proxy.app import _ServerLog
from prefixroute.adapters.proxy.prompts import ByteEncoder
from prefixroute.testing.openai_engine import OpenAIEngine

from ..conftest import BuggyPolicy, running_engines, wait_until
from .conftest import Handler, backend_serving, metric_samples

JSON_BODY = {"Content-Type": "application/json"}


class Clock:
    """A clock the test moves by hand (the proxy's cooldowns read it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine() -> Iterator[OpenAIEngine]:
    for engines in running_engines(1, max_tokens=2):
        yield engines[0]


@pytest.fixture
def fine(engine: OpenAIEngine) -> Iterator[OpenAIEngine]:
    """The module's engine, put back to normal after each test."""
    yield engine
    engine.fail_next(0)
    engine.resume()
    engine.accept()


async def answered(request: web.Request) -> web.Response:
    """A completion answered at once."""
    return web.json_response({"choices": [{"text": "ok"}]})


class Listing:
    """A backend's ``GET /v1/models``: answers ``cards`` (or 500 while None) and notes each asker's key."""

    def __init__(self, cards: list[dict[str, object]] | None) -> None:
        self.cards = cards
        self.keys: list[str | None] = []

    async def answer(self, request: web.Request) -> web.Response:
        self.keys.append(request.headers.get("Authorization"))
        if self.cards is None:
            return web.json_response({"error": {"message": "down"}}, status=500)
        return web.json_response({"object": "list", "data": self.cards})


def post(proxy: Proxy, body: dict[str, object]) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)


def settled(proxy: Proxy, requests: int) -> None:
    """Wait until ``requests`` requests have their outcome counted (a handler counts in its ``finally``)."""

    def counted() -> bool:
        s = proxy.stats()
        outcomes = (s.ok, s.backend_error, s.unreachable, s.client_disconnect, s.bad_request, s.internal_error)
        return sum(outcomes) >= requests

    wait_until(counted, what=f"{requests} outcomes counted")


def test_a_backend_unreachable_max_failures_times_in_a_row_sits_out_exactly_its_cooldown(
    refused_port: Callable[[], int],
) -> None:
    clock = Clock()
    dead = f"http://127.0.0.1:{refused_port()}"
    with Proxy(Router(), [dead], max_failures=2, cooldown=10, clock=clock, retries=0, base_models=[]) as proxy:
        assert post(proxy, {"prompt": "a"}).status_code == 502
        assert proxy.stats().unhealthy == ()  # one failure of the two
        assert post(proxy, {"prompt": "b"}).status_code == 502
        assert proxy.stats().unhealthy == (dead,)
        health = httpx.get(proxy.url + "/healthz")
        assert (health.status_code, health.json()) == (503, {"status": "unavailable", "healthy_backends": []})
        clock.now += 9.5
        assert proxy.stats().unhealthy == (dead,)
        clock.now = 1010.0  # the cooldown is over: back in rotation
        assert proxy.stats().unhealthy == ()
        health = httpx.get(proxy.url + "/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ok", "healthy_backends": [dead]})
        # Its count started again when it left: one more failure is not "max_failures in a row".
        assert post(proxy, {"prompt": "c"}).status_code == 502
        assert proxy.stats().unhealthy == ()
        assert post(proxy, {"prompt": "d"}).status_code == 502
        assert proxy.stats().unhealthy == (dead,)
        assert proxy.stats().unreachable == 4


def test_a_5xx_answer_is_a_failure_in_a_row_that_a_success_or_a_4xx_ends(fine: OpenAIEngine) -> None:
    clock = Clock()
    with Proxy(Router(), [fine.url], max_failures=2, clock=clock, base_models=[]) as proxy:
        fine.fail_next(1, status=500)
        assert post(proxy, {"prompt": "a"}).status_code == 500
        assert post(proxy, {"prompt": "b"}).status_code == 200  # ends the run of failures
        fine.fail_next(1, status=500)
        assert post(proxy, {"prompt": "c"}).status_code == 500
        assert proxy.stats().unhealthy == ()  # one in a row, not two
        fine.fail_next(1, status=400)
        assert post(proxy, {"prompt": "d"}).status_code == 400  # a refusal of the client: the engine is fine
        fine.fail_next(1, status=500)
        assert post(proxy, {"prompt": "e"}).status_code == 500
        assert proxy.stats().unhealthy == ()
        fine.fail_next(1, status=500)
        assert post(proxy, {"prompt": "f"}).status_code == 500
        settled(proxy, 6)
        stats = proxy.stats()
        assert stats.unhealthy == (fine.url,)
        assert (stats.ok, stats.backend_error) == (2, 4)  # a 4xx was answered: ok


def test_a_single_5xx_takes_a_backend_out_when_max_failures_is_one(fine: OpenAIEngine) -> None:
    with Proxy(Router(), [fine.url], max_failures=1, clock=Clock(), base_models=[]) as proxy:
        fine.fail_next(1, status=503)
        assert post(proxy, {"prompt": "a", "stream": True}).status_code == 503
        assert proxy.stats().unhealthy == (fine.url,)


def test_a_backend_that_answers_whole_while_every_backend_is_out_is_back_in_rotation_at_once(
    fine: OpenAIEngine, refused_port: Callable[[], int]
) -> None:
    # Was: with every backend cooling down, all are tried, and one answered whole; its streak of failures ended, but
    # its cooldown ran on, so /healthz answered 503 and /metrics had it down while it served every request.
    clock = Clock()
    dead = f"http://127.0.0.1:{refused_port()}"
    with Proxy(Router(), [dead, fine.url], max_failures=1, cooldown=10, clock=clock, base_models=[]) as proxy:
        fine.fail_next(1, status=500)
        for prompt in ("a", "b"):  # one request may take both out (the dead one, then its retry's 500)
            if len(proxy.stats().unhealthy) < 2:
                post(proxy, {"prompt": prompt})
        assert sorted(proxy.stats().unhealthy) == sorted([dead, fine.url])
        assert httpx.get(proxy.url + "/healthz").status_code == 503
        clock.now += 1
        assert post(proxy, {"prompt": "c"}).status_code == 200  # every backend tried: the live one answers
        health = httpx.get(proxy.url + "/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ok", "healthy_backends": [fine.url]})
        assert proxy.stats().unhealthy == (dead,)
        up = metric_samples(httpx.get(proxy.url + "/metrics"))["prefixroute_proxy_backend_up"]
        assert up == {(("backend", dead),): 0, (("backend", fine.url),): 1}
        retries = proxy.stats().retries
        reply = post(proxy, {"prompt": "d"})  # routed as /healthz says: to the live one only, never to the dead one
        assert (reply.status_code, reply.headers["x-prefixroute-backend"]) == (200, fine.url)
        assert proxy.stats().retries == retries


def test_a_request_sent_before_a_backends_cooldown_does_not_end_it(fine: OpenAIEngine) -> None:
    """Only a whole answer to a request sent while a backend was out brings it back early. A stream still finishing
    on an engine that has begun to fail (a rolling restart: its listener gone, old streams ending) put it back in
    rotation, and each new request paid a refused connection and a retry."""
    release = threading.Event()
    calls: list[int] = []

    async def answered(request: web.Request) -> web.Response:
        calls.append(1)
        if len(calls) == 1:  # the first, in flight while the backend fails the second
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
            return web.json_response({"choices": [{"text": "ok"}]})
        return web.json_response({"error": "down"}, status=500)

    class Prefers(LoadPolicy):  # the failing backend while it is in rotation
        def choose(self, candidates: Sequence[Candidate]) -> Candidate:
            return next((c for c in candidates if c.backend == failing), candidates[0])

    with (
        backend_serving(answered) as failing,
        Proxy(Router(policy=Prefers()), [failing, fine.url], max_failures=1, base_models=[]) as proxy,
    ):
        body = {"prompt": "x" * 64, "max_tokens": 1}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, proxy, body)
            wait_until(lambda: len(calls) == 1, what="the first request at the engine")
            assert post(proxy, body).status_code == 500
            assert proxy.stats().unhealthy == (failing,)
            release.set()
            assert first.result(timeout=30).status_code == 200
        assert proxy.stats().unhealthy == (failing,)  # its cooldown runs on
        assert httpx.get(proxy.url + "/healthz").json()["healthy_backends"] == [fine.url]


def test_every_metric_family_says_what_it_counts(fine: OpenAIEngine) -> None:
    """Each family has its HELP line as well as its TYPE (promtool warns of a family without; it had none)."""
    with Proxy(Router(), [fine.url], base_models=[]) as proxy:
        families = list(text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text))
    assert len(families) == 6 and all(family.documentation for family in families), families


def test_metrics_count_each_outcome_retry_skip_and_backend_state_by_name(
    fine: OpenAIEngine, refused_port: Callable[[], int]
) -> None:
    dead = f"http://127.0.0.1:{refused_port()}"
    with Proxy(Router(policy=RoundRobin()), [dead, fine.url], max_failures=1, clock=Clock()) as proxy:
        # At start the proxy asked both for their models: the dead one was skipped once. Listing asks again.
        assert httpx.get(proxy.url + "/v1/models").status_code == 200
        # Round robin sends one of these two to the dead backend: refused, it is retried on the other, and out.
        for prompt in ("first", "second"):
            assert post(proxy, {"prompt": prompt}).status_code == 200
        assert post(proxy, {"prompt": ""}).status_code == 400
        settled(proxy, 3)
        samples = metric_samples(httpx.get(proxy.url + "/metrics"))
    requests = {labels[0][1]: value for labels, value in samples["prefixroute_proxy_requests_total"].items()}
    assert requests == {"ok": 2, "backend_error": 0, "unreachable": 0, "client_disconnect": 0, "bad_request": 1,
                        "internal_error": 0}  # fmt: skip
    assert samples["prefixroute_proxy_retries_total"] == {(): 1}
    assert samples["prefixroute_router_decisions_total"] == {(): proxy.router.stats().decisions}
    by_backend = {name: {labels[0][1]: value for labels, value in samples[name].items()}
                  for name in ("prefixroute_router_in_flight", "prefixroute_proxy_backend_up",
                               "prefixroute_proxy_models_skipped_total")}  # fmt: skip
    assert by_backend == {
        "prefixroute_router_in_flight": {dead: 0, fine.url: 0},
        "prefixroute_proxy_backend_up": {dead: 0, fine.url: 1},
        "prefixroute_proxy_models_skipped_total": {dead: 2, fine.url: 0},
    }


def test_metrics_escape_a_quote_and_a_backslash_in_a_backend_label() -> None:
    url = 'http://127.0.0.1:9/a"b\\c'
    proxy = Proxy(Router(), [url], base_models=[])
    text = proxy.metrics_text()
    assert 'prefixroute_proxy_backend_up{backend="http://127.0.0.1:9/a\\"b\\\\c"} 1\n' in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.labels["backend"] for s in families["prefixroute_router_in_flight"].samples] == [url]
    assert text.endswith("\n") and families["prefixroute_proxy_models_skipped"].type == "counter"


@pytest.mark.parametrize(("status", "max_failures", "out"), [(200, 1, True), (500, 2, False), (500, 1, True)])
def test_an_answer_broken_off_midway_is_a_502_and_one_failure_of_its_backend(
    status: int, max_failures: int, out: bool
) -> None:
    async def breaking(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        answer.content_length = 100
        await answer.prepare(request)
        await answer.write(b'{"choices": [')  # then the engine dies, 87 bytes short
        assert request.transport is not None
        request.transport.abort()
        return answer

    with (
        backend_serving(breaking) as url,
        Proxy(Router(), [url], max_failures=max_failures, clock=Clock(), base_models=[]) as proxy,
    ):
        reply = post(proxy, {"prompt": "x"})
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("BadGatewayError", 502)
        assert "broke off its answer" in error["message"]
        settled(proxy, 1)
        assert proxy.stats().backend_error == 1
        # One request, one failure: a 5xx counted when it answered, not again when it broke off.
        assert proxy.stats().unhealthy == ((proxy.backends[0],) if out else ())


def test_a_request_naming_a_model_asks_unlisted_backends_again_at_most_every_10_s_with_its_key(
    fine: OpenAIEngine,
) -> None:
    clock = Clock()
    listing = Listing(None)  # fails to list: its models stay unknown
    with (
        backend_serving(answered, listing.answer) as flaky,
        Proxy(Router(), [fine.url, flaky], clock=clock) as proxy,
    ):
        assert proxy.base_models == {"fake-model"}  # the other one listed at start

        def ask(key: str, body: dict[str, object]) -> None:
            reply = httpx.post(proxy.url + "/v1/completions", json=body, headers={"Authorization": key}, timeout=10)
            assert reply.status_code == 200, reply.text

        ask("k1", {"model": "fake-model", "prompt": "a"})  # a base model, but one backend has not listed: ask again
        wait_until(lambda: "k1" in listing.keys, what="the listing k1 asked for")
        clock.now = 1009.5
        ask("k2", {"model": "fake-model", "prompt": "b"})  # within 10 s of the last: not again
        clock.now = 1010.0
        ask("k3", {"prompt": "c"})  # names no model: nothing to learn
        ask("k4", {"model": "fake-model", "prompt": "d"})  # 10 s on: again
        wait_until(lambda: "k4" in listing.keys, what="the listing k4 asked for")
        assert listing.keys == [None, "k1", "k4"]


def test_once_every_backend_listed_only_a_model_without_a_known_base_asks_again() -> None:
    clock = Clock()
    listing = Listing([{"id": "adapter", "object": "model", "parent": "elsewhere"}])  # no base model among them
    with backend_serving(answered, listing.answer) as url:
        with Proxy(Router(), [url], clock=clock) as learning:
            assert learning.base_models == frozenset()
            reply = httpx.post(learning.url + "/v1/completions", json={"model": "adapter", "prompt": "a"},
                               headers={"Authorization": "k1"})  # fmt: skip
            assert reply.status_code == 200
            wait_until(lambda: "k1" in listing.keys, what="the listing k1 asked for")
            assert listing.keys == [None, "k1"]
        listing.keys.clear()
        with Proxy(Router(), [url], clock=clock, base_models=[]) as given:  # given: nothing to learn
            assert httpx.get(given.url + "/v1/models", headers={"Authorization": "k0"}).status_code == 200
            reply = httpx.post(given.url + "/v1/completions", json={"model": "adapter", "prompt": "a"},
                               headers={"Authorization": "k1"})  # fmt: skip
            assert reply.status_code == 200
            assert httpx.get(given.url + "/v1/models", headers={"Authorization": "k2"}).status_code == 200
            assert listing.keys == ["k0", "k2"]  # every backend had listed: the request asked nothing


@pytest.mark.parametrize(("status", "relayed"), [(400, 400), (499, 499), (500, 502), (503, 502)])
def test_models_relay_a_4xx_refusal_as_the_engine_gave_it_and_answer_a_5xx_with_502(status: int, relayed: int) -> None:
    async def refusing(request: web.Request) -> web.Response:
        return web.Response(status=status, text="no models for you", content_type="text/plain")

    with backend_serving(answered, refusing) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        reply = httpx.get(proxy.url + "/v1/models")
        assert reply.status_code == relayed
        if relayed < 500:
            assert reply.text == "no models for you" and reply.headers["content-type"].startswith("text/plain")
        else:
            assert reply.json()["error"] == {"message": "no backend answered /v1/models", "type": "BadGatewayError",
                                             "param": None, "code": 502}  # fmt: skip


def test_a_backend_taken_out_of_rotation_is_logged_with_its_count_and_cooldown(
    refused_port: Callable[[], int], caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{refused_port()}"
    with (
        caplog.at_level(logging.WARNING, logger="prefixroute.proxy"),
        Proxy(Router(), [dead], max_failures=2, cooldown=7, clock=Clock(), retries=0, base_models=[]) as proxy,
    ):
        for prompt in ("a", "b"):
            assert post(proxy, {"prompt": prompt}).status_code == 502
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixroute.proxy"]
    assert lines == [f"backend {dead} failed 2 times in a row: out of rotation for 7 s"]


def test_a_failing_policy_is_logged_with_the_policys_own_exception(
    fine: OpenAIEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="prefixroute.proxy"),
        Proxy(Router(policy=BuggyPolicy()), [fine.url], base_models=[]) as proxy,
    ):
        assert post(proxy, {"prompt": "hello"}).status_code == 500
    [record] = [r for r in caplog.records if r.name == "prefixroute.proxy"]
    assert record.levelno == logging.ERROR
    assert (
        record.getMessage().startswith("the routing policy failed: ") and "a bug in the policy" in record.getMessage()
    )
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
    assert str(record.exc_info[1]) == "a bug in the policy"


def _server_log_records(
    caplog: pytest.LogCaptureFixture, level: int, msg: str, *args: object, **kwargs: Any
) -> list[logging.LogRecord]:
    """What aiohttp's server log, as the proxy wraps it, records for one ``log(*args, **kwargs)`` call."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="test.serverlog"):
        _ServerLog(logging.getLogger("test.serverlog")).log(level, msg, *args, **kwargs)
    return [r for r in caplog.records if r.name == "test.serverlog"]


def test_a_malformed_request_is_one_warning_line_and_the_proxys_own_errors_keep_their_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    malformed = BadHttpMessage("Invalid header value char")
    [record] = _server_log_records(caplog, logging.ERROR, "Error handling request", exc_info=malformed)
    assert (record.levelno, record.exc_info) == (logging.WARNING, None)
    assert record.getMessage() == "Error handling request: 400 Invalid header value char"
    quoting = BadHttpMessage("Invalid header value char:\n\n  b'Authorization: Bearer sk-key\\x01'\n     ^")
    [record] = _server_log_records(caplog, logging.ERROR, "Error handling request", exc_info=quoting)
    assert record.getMessage() == "Error handling request: 400 Invalid header value char"  # not the request's bytes
    apostrophe = BadHttpMessage("Transfer-Encoding can't be present with Content-Length: b'POST / HTTP/1.1'")
    [record] = _server_log_records(caplog, logging.ERROR, "Error handling request", exc_info=apostrophe)
    assert record.getMessage() == "Error handling request: 400 Transfer-Encoding can't be present with Content-Length"
    corrupt = RequestPayloadError("bad gzip\n  data")
    [record] = _server_log_records(caplog, logging.ERROR, "Error handling request from %s", "10.0.0.1",
                                   exc_info=corrupt)  # fmt: skip
    assert (record.levelno, record.exc_info) == (logging.WARNING, None)
    assert record.getMessage() == "Error handling request from 10.0.0.1: bad gzip data"
    bug = ValueError("the proxy's own bug")
    [record] = _server_log_records(caplog, logging.ERROR, "Error handling %s", "request", exc_info=bug)
    assert (record.levelno, record.getMessage()) == (logging.ERROR, "Error handling request")
    assert record.exc_info is not None and record.exc_info[1] is bug
    [record] = _server_log_records(caplog, logging.INFO, "plain %s", "line", stack_info=True)
    assert (record.levelno, record.getMessage()) == (logging.INFO, "plain line") and record.stack_info


def _model_list_of_size(model: str, size: int) -> bytes:
    """A one-card model list of exactly ``size`` bytes (a padding field fills it)."""
    head = b'{"object": "list", "data": [{"id": "' + model.encode() + b'", "object": "model", "pad": "'
    tail = b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def test_a_model_list_is_read_whole_up_to_16_mib_and_skipped_past_it(caplog: pytest.LogCaptureFixture) -> None:
    many = [{"id": f"model-{i}", "object": "model"} for i in range(3000)]  # ~100 KB: read in several chunks
    answers = {
        "many": json.dumps({"object": "list", "data": many}).encode(),
        "exact": _model_list_of_size("exact", 16 * 2**20),
        "over": _model_list_of_size("over", 16 * 2**20 + 1),
    }
    assert (len(answers["exact"]), len(answers["over"])) == (16 * 2**20, 16 * 2**20 + 1)

    def listing(name: str) -> Handler:
        async def answer(request: web.Request) -> web.Response:
            return web.Response(body=answers[name], content_type="application/json")

        return answer

    with (
        caplog.at_level(logging.WARNING, logger="prefixroute.proxy"),
        backend_serving(answered, listing("many")) as a,
        backend_serving(answered, listing("exact")) as b,
        backend_serving(answered, listing("over")) as c,
        Proxy(Router(), [a, b, c], models_timeout=60, base_models=[]) as proxy,
    ):
        reply = httpx.get(proxy.url + "/v1/models", timeout=30)
        assert reply.status_code == 200
        assert [card["id"] for card in reply.json()["data"]] == [card["id"] for card in many] + ["exact"]
        assert proxy.stats().models_skipped == 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "prefixroute.proxy"]
    assert line == f"backend {c} is left out of /v1/models until it lists again: its answer is no model list: " + (
        f"over {16 * 2**20} bytes"
    )


def test_answers_name_the_backend_reason_and_matched_tokens_of_their_decision(fine: OpenAIEngine) -> None:
    prompt = list(range(7000, 7064))  # four 16-token blocks
    with Proxy(Router(), [fine.url], base_models=[]) as proxy:
        first = post(proxy, {"prompt": prompt})
        again = post(proxy, {"prompt": [*prompt, 1], "stream": True})
    assert (first.headers["x-prefixroute-backend"], first.headers["x-prefixroute-matched-tokens"]) == (fine.url, "0")
    assert (again.headers["x-prefixroute-reason"], again.headers["x-prefixroute-matched-tokens"]) == ("prefix", "64")


class _BrokenEncoder:
    """An encoder with a bug (not a bad prompt): it raises what no prompt should make it raise."""

    def encode(self, text: str) -> list[int]:
        raise RuntimeError("the encoder's own bug")

    def encode_chat(self, messages: Any) -> list[int]:
        raise RuntimeError("the encoder's own bug")


def test_an_encoder_that_breaks_is_the_proxys_500_not_the_clients_400(
    fine: OpenAIEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="prefixroute.proxy"),
        Proxy(Router(), [fine.url], encoder=_BrokenEncoder(), base_models=[]) as proxy,
    ):
        reply = post(proxy, {"prompt": "text needs the encoder"})
        assert reply.status_code == 500
        assert reply.json()["error"] == {
            "message": "the proxy failed to route the request: the encoder's own bug",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        stats = proxy.stats()
        assert (stats.internal_error, stats.bad_request) == (1, 0) and proxy.router.stats().decisions == 0
    assert [r.getMessage() for r in caplog.records if r.name == "prefixroute.proxy"] == ["routing a request failed"]


def test_a_backend_that_takes_the_request_and_drops_it_is_a_502_and_a_failure() -> None:
    async def dropping(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()  # took the request, answers nothing
        return web.Response()

    with (
        backend_serving(dropping) as url,
        Proxy(Router(), [url], max_failures=1, clock=Clock(), base_models=[]) as proxy,
    ):
        reply = post(proxy, {"prompt": "x"})
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("BadGatewayError", 502)
        assert error["message"].startswith(f"backend {url} failed to answer: ")
        settled(proxy, 1)
        stats = proxy.stats()
        assert (stats.backend_error, stats.unreachable, stats.retries, stats.unhealthy) == (1, 0, 0, (url,))


def test_health_answers_as_healthz_does(fine: OpenAIEngine) -> None:
    with Proxy(Router(), [fine.url], base_models=[]) as proxy:
        for path in ("/health", "/healthz"):
            reply = httpx.get(proxy.url + path)
            assert (reply.status_code, reply.json()) == (200, {"status": "ok", "healthy_backends": [fine.url]}), path


def test_a_cors_preflight_gets_starlettes_defaults_and_anything_else_goes_on(fine: OpenAIEngine) -> None:
    """vLLM's server is Starlette's CORSMiddleware allowing everything: every method, the headers asked for, and a
    preflight cached 600 s. An OPTIONS that is no preflight (no Origin, or no method asked for) is no preflight."""
    asked = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "x-custom"}  # fmt: skip

    async def own_cors(request: web.Request) -> web.Response:
        return web.json_response({"ok": True}, headers={"Access-Control-Allow-Origin": "http://ui.example"})

    with backend_serving(own_cors) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        preflight = httpx.options(proxy.url + "/v1/completions", headers=asked)
        assert (preflight.status_code, preflight.text) == (200, "OK")
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert preflight.headers["access-control-allow-methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
        assert preflight.headers["access-control-max-age"] == "600"
        assert preflight.headers["access-control-allow-headers"] == "x-custom"
        for partial in ({"Origin": "http://ui.example"}, {"Access-Control-Request-Method": "POST"}):
            reply = httpx.options(proxy.url + "/v1/completions", headers=partial)
            assert reply.status_code == 405 and reply.json()["error"]["type"] == "MethodNotAllowedError", partial
            assert ("access-control-allow-origin" in reply.headers) == ("Origin" in partial)
        # The engine's own CORS answer stands: the proxy adds "*" only where the answer says nothing.
        relayed = httpx.post(
            proxy.url + "/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://ui.example"}
        )
        assert relayed.headers.get_list("access-control-allow-origin") == ["http://ui.example"]


def test_stop_closes_the_proxys_port_and_is_idempotent(fine: OpenAIEngine) -> None:
    proxy = Proxy(Router(), [fine.url], base_models=[])
    proxy.stop()  # never started: nothing to stop
    with proxy:
        url = proxy.url
        assert httpx.get(url + "/healthz").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/healthz")
    proxy.stop()


def test_a_second_start_is_refused_and_the_first_server_keeps_serving_until_stop(fine: OpenAIEngine) -> None:
    """A second start() used to take over the first server's session and listener: the first kept listening on a
    thread that stop() no longer reached."""
    before = set(threading.enumerate())
    proxy = Proxy(Router(), [fine.url], base_models=[]).start()
    url = proxy.url
    with pytest.raises(StateError, match=rf"the proxy is serving already, at {url}: stop it"):
        proxy.start()

    async def serve_too() -> None:
        await proxy.serve()

    with pytest.raises(StateError, match="the proxy is serving already"):
        asyncio.run(serve_too())
    assert httpx.get(url + "/healthz").status_code == 200
    proxy.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/healthz")
    assert set(threading.enumerate()) <= before
    with proxy:  # stopped, it starts again
        assert httpx.get(proxy.url + "/healthz").status_code == 200


def test_stop_from_several_threads_at_once_stops_the_proxy_and_the_engine_once() -> None:
    """Was: each stop() checked the server thread's fields before another cleared them: AttributeError ('NoneType'
    object has no attribute 'join') in most rounds."""
    failures: list[BaseException] = []

    def stop(server: Proxy | OpenAIEngine, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            server.stop()
        except BaseException as exc:  # noqa: BLE001 - every failure is the finding
            failures.append(exc)

    before = set(threading.enumerate())
    for _ in range(20):
        engine = OpenAIEngine().start()
        proxy = Proxy(Router(), [engine.url], base_models=[]).start()
        for server in (proxy, engine):
            barrier = threading.Barrier(3)
            stoppers = [threading.Thread(target=stop, args=(server, barrier)) for _ in range(3)]
            for thread in stoppers:
                thread.start()
            for thread in stoppers:
                thread.join(20)
            assert not any(thread.is_alive() for thread in stoppers), "a stop() hung"
    assert failures == []
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize(
    ("where", "error", "message"),
    [
        (
            {"port": 70000},
            ConfigurationError,
            r"port must be an int in \[0, 65535\] \(0: one the OS picks\), not 70000",
        ),
        ({"port": -1}, ConfigurationError, "port must be an int in"),
        ({"port": "8080"}, ConfigurationError, "port must be an int in .*not '8080'"),
        ({"port": 80.0}, ConfigurationError, "port must be an int in"),
        ({"host": ""}, ConfigurationError, "host: expected a host name or address"),
        ({"host": "gpu 0"}, ConfigurationError, "host: expected a host name or address"),
        ({"host": None}, InvalidTypeError, "a host is a str, not NoneType"),
    ],
)
def test_where_to_listen_is_checked_before_anything_starts(
    fine: OpenAIEngine, where: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Was: a port past 65535 or below 0 raised OverflowError from inside asyncio, "8080" was taken, and a host of
    None or "" listened on every interface without saying so."""
    before = set(threading.enumerate())
    proxy = Proxy(Router(), [fine.url], base_models=[])
    with pytest.raises(error, match=message):
        proxy.start(**where)

    async def serve() -> None:
        await proxy.serve(**where)

    with pytest.raises(error, match=message):
        asyncio.run(serve())
    assert set(threading.enumerate()) <= before
    with proxy:  # nothing was started: it starts as usual
        assert httpx.get(proxy.url + "/healthz").status_code == 200


def test_a_start_that_failed_leaves_the_proxy_ready_to_start_again(fine: OpenAIEngine) -> None:
    proxy = Proxy(Router(), [fine.url], base_models=[])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            proxy.start(port=port)
    proxy.start(port=port)  # the port is free now: the failed start left nothing behind
    try:
        assert httpx.get(proxy.url + "/healthz").status_code == 200
    finally:
        proxy.stop()


def test_start_listens_on_the_port_given_or_else_on_one_the_os_picks(fine: OpenAIEngine) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    given = Proxy(Router(), [fine.url], base_models=[]).start(host="127.0.0.2", port=port)  # loopback too
    try:
        assert given.url == f"http://127.0.0.2:{port}"
        assert httpx.get(given.url + "/healthz").status_code == 200
    finally:
        given.stop()
    with Proxy(Router(), [fine.url], base_models=[]) as one, Proxy(Router(), [fine.url], base_models=[]) as two:
        ports = {int(one.url.rsplit(":", 1)[1]), int(two.url.rsplit(":", 1)[1])}
        assert len(ports) == 2 and all(p > 1024 for p in ports)  # the OS's ephemeral ports, one each


def test_a_backend_failing_to_list_is_warned_about_once_until_it_lists_again(caplog: pytest.LogCaptureFixture) -> None:
    listing = Listing(None)
    with (
        caplog.at_level(logging.DEBUG, logger="prefixroute.proxy"),
        backend_serving(answered, listing.answer) as url,
        Proxy(Router(), [url], base_models=[]) as proxy,
    ):

        def listed() -> list[tuple[int, str]]:
            reply = httpx.get(proxy.url + "/v1/models")
            lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "prefixroute.proxy"]
            caplog.clear()
            assert reply.status_code == (502 if listing.cards is None else 200)
            return lines

        left_out = f"backend {url} is left out of /v1/models until it lists again: HTTP 500"
        assert listed() == [(logging.WARNING, left_out)]
        assert listed() == [(logging.DEBUG, left_out)]  # still failing: said already
        listing.cards = [{"id": "m", "object": "model"}]
        assert listed() == []
        listing.cards = None
        assert listed() == [(logging.WARNING, left_out)]  # failing anew: said again
        assert proxy.stats().models_skipped == 3


def test_by_default_3_failures_in_a_row_take_a_backend_out_for_10_s(refused_port: Callable[[], int]) -> None:
    """The documented defaults: "A backend failing 3 times in a row leaves the rotation for 10 s"; one retry."""
    clock = Clock()
    dead = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    with Proxy(Router(policy=RoundRobin()), dead, clock=clock, base_models=[]) as proxy:
        for i in range(3):  # each tries both (one retry): 3 failures of each
            assert post(proxy, {"prompt": f"p{i}"}).status_code == 502
            assert sorted(proxy.stats().unhealthy) == ([] if i < 2 else sorted(dead))
        assert proxy.stats().retries == 3
        clock.now += 9.9
        assert sorted(proxy.stats().unhealthy) == sorted(dead)
        clock.now = 1010.0
        assert proxy.stats().unhealthy == ()


def test_a_model_list_broken_off_is_skipped_and_the_log_names_the_error(caplog: pytest.LogCaptureFixture) -> None:
    async def breaking(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"Content-Type": "application/json"})
        answer.content_length = 100
        await answer.prepare(request)
        await answer.write(b'{"object": "list", "data": [')
        assert request.transport is not None
        request.transport.abort()
        return answer

    with (
        caplog.at_level(logging.WARNING, logger="prefixroute.proxy"),
        backend_serving(answered, breaking) as url,
        Proxy(Router(), [url], base_models=[]) as proxy,
    ):
        assert httpx.get(proxy.url + "/v1/models").status_code == 502
    [line] = [r.getMessage() for r in caplog.records if r.name == "prefixroute.proxy"]
    assert line.startswith(f"backend {url} is left out of /v1/models until it lists again: ClientPayloadError: ")


def test_more_than_a_hundred_streams_reach_one_backend_at_once() -> None:
    """The proxy's own connection pool sets no limit (aiohttp's default would be 100 connections): the engine, not
    the proxy, decides how many requests it runs at once (vLLM's ``max_num_seqs`` is often 256)."""
    streams = 105
    released = threading.Event()

    async def holding(request: web.Request) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'data: {"choices": [{"text": "t0"}]}\n\n')
        while not released.is_set():  # generating, until every stream has started
            await asyncio.sleep(0.01)
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def clients(proxy: Proxy) -> int:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        started = 0
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:

            async def one(i: int) -> None:
                nonlocal started
                body = {"prompt": f"stream {i}", "stream": True}
                async with client.stream("POST", proxy.url + "/v1/completions", json=body) as reply:
                    assert reply.status_code == 200
                    chunks = reply.aiter_raw()
                    await anext(chunks)  # its first chunk: the backend holds it open now
                    started += 1
                    if started == streams:
                        released.set()
                    async for _ in chunks:  # the rest, once released
                        pass

            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(streams))), timeout=30)
        return started

    with backend_serving(holding) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        try:
            assert asyncio.run(clients(proxy)) == streams
        finally:
            released.set()
        wait_until(lambda: proxy.stats().ok == streams, what="every stream served")


def test_a_backend_that_never_takes_the_connection_is_retried_elsewhere_after_connect_timeout(
    fine: OpenAIEngine,
) -> None:
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        stuck = f"http://127.0.0.1:{full.getsockname()[1]}"
        # One connection fills its accept queue (nothing accepts it): the next ones wait for ever to be taken.
        with (
            socket.create_connection(full.getsockname()),
            Proxy(Router(policy=RoundRobin()), [stuck, fine.url], connect_timeout=0.5, base_models=[]) as proxy,
        ):
            replies = [httpx.post(proxy.url + "/v1/completions", json={"prompt": p}, timeout=20) for p in ("a", "b")]
            assert [r.status_code for r in replies] == [200, 200]
            assert {r.headers["x-prefixroute-backend"] for r in replies} == {fine.url}
            stats = proxy.stats()
            assert stats.retries >= 1 and stats.unreachable == 0  # round robin sent one or both to the stuck one


def test_serve_on_the_callers_loop_listens_on_loopback_on_a_port_the_os_picks(fine: OpenAIEngine) -> None:
    async def both() -> list[str]:
        proxies = [Proxy(Router(), [fine.url], base_models=[]) for _ in range(2)]
        try:
            urls = [await proxy.serve() for proxy in proxies]
            async with httpx.AsyncClient() as client:
                assert [(await client.get(url + "/healthz")).status_code for url in urls] == [200, 200]
            return urls
        finally:
            for proxy in proxies:
                await proxy.aclose()

    urls = asyncio.run(both())
    assert all(url.startswith("http://127.0.0.1:") for url in urls) and urls[0] != urls[1]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"backends": []}, ConfigurationError, "the proxy needs at least one backend URL"),
        (
            {"backends": ["http://a:1", "http://gpu0", "http://GPU0:80/"]},
            ConfigurationError,
            # Was the whole list, however long, in the message: now the two spellings that name one engine.
            "backends list 'http://gpu0' and 'http://GPU0:80', one engine (http://gpu0:80): list each backend once",
        ),
        ({"router": "router"}, InvalidTypeError, "router must be a prefixroute.Router, not str"),
        ({"retries": 17}, ConfigurationError, "retries must be an int in [0, 16], not 17"),
        ({"max_failures": 0}, ConfigurationError, "max_failures must be an int >= 1, not 0"),
        ({"cooldown": 0}, ConfigurationError, "cooldown must be a positive, finite number of seconds, not 0"),
        ({"cooldown": -1.0}, ConfigurationError, "cooldown must be a positive, finite number of seconds"),
        ({"connect_timeout": 0.0}, ConfigurationError, "connect_timeout must be a positive, finite number of seconds"),
        ({"base_models": ["llama", " "]}, ConfigurationError, "base_models must name models, not [' ', 'llama']"),
        ({"base_models": ["llama", "qwen", "llama"]}, ConfigurationError, "base_models names 'llama' twice"),
        ({"fleet": object()}, InvalidTypeError, "fleet must be a prefixroute.vllm.Fleet or None, not object"),
        ({"clock": 1.0}, InvalidTypeError, "clock must be a callable returning seconds, not float"),
        ({"backends": ("http://a:1", 5)}, InvalidTypeError, "backends must hold backend URLs (str), not int"),
    ],
)
def test_options_out_of_their_documented_range_are_refused_with_what_to_fix(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments: dict[str, Any] = {"router": Router(), "backends": ["http://127.0.0.1:8000"], **options}
    with pytest.raises(error) as refused:
        Proxy(**arguments)
    assert str(refused.value).startswith(message)


def test_the_bounds_of_the_documented_ranges_are_taken() -> None:
    proxy = Proxy(Router(), ["http://127.0.0.1:8000"], retries=0, max_failures=1, cooldown=0.001,
                  connect_timeout=0.001, models_timeout=0.001, max_body_bytes=1, base_models=[])  # fmt: skip
    assert (proxy.max_body_bytes, proxy.base_models, proxy.backends) == (1, frozenset(), ("http://127.0.0.1:8000",))
    Proxy(Router(), ["http://127.0.0.1:8000"], retries=16)  # the most resends, MAX_RETRIES, is taken too


class _HundredIds(ByteEncoder):
    """An encoder that knows the engine's largest token id, as the model's tokenizer does."""

    max_token_id = 100


def test_an_encoder_with_an_int_max_token_id_has_ids_past_it_refused_before_routing(fine: OpenAIEngine) -> None:
    with Proxy(Router(), [fine.url], encoder=_HundredIds(), base_models=[]) as proxy:
        past = post(proxy, {"prompt": [5, 101]})
        assert past.status_code == 400
        assert past.json()["error"]["message"] == "Token id 101 is out of vocabulary"
        assert proxy.router.stats().decisions == 0
        assert post(proxy, {"prompt": [5, 100]}).status_code == 200  # the largest id itself is in the vocabulary
    with Proxy(Router(), [fine.url], base_models=[]) as unknowing:  # no max_token_id: ids go on as sent
        assert post(unknowing, {"prompt": [5, 101]}).status_code == 200


def test_an_ipv6_listener_gets_a_bracketed_url(fine: OpenAIEngine) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proxy = Proxy(Router(), [fine.url], base_models=[]).start(host="::1")
    try:
        host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
        assert host == "[::1]" and int(port) > 1024
        assert httpx.get(proxy.url + "/healthz").status_code == 200
    finally:
        proxy.stop()


def test_a_stopped_proxy_can_listen_again_on_its_port_at_once(fine: OpenAIEngine) -> None:
    first = Proxy(Router(), [fine.url], base_models=[]).start()
    try:
        port = int(first.url.rsplit(":", 1)[1])
        with httpx.Client() as client:  # a kept-alive connection, closed by the proxy as it stops
            assert client.get(first.url + "/healthz").status_code == 200
            first.stop()
    finally:
        first.stop()
    again = Proxy(Router(), [fine.url], base_models=[]).start(port=port)  # its old connection may be in TIME_WAIT
    try:
        assert httpx.get(again.url + "/healthz").status_code == 200
    finally:
        again.stop()


def test_by_default_a_refused_request_is_retried_once_not_on_every_backend(refused_port: Callable[[], int]) -> None:
    dead = [f"http://127.0.0.1:{refused_port()}" for _ in range(3)]
    with Proxy(Router(), dead, clock=Clock(), base_models=[]) as proxy:
        reply = post(proxy, {"prompt": "x"})
        assert reply.status_code == 502 and "is unreachable" in reply.json()["error"]["message"]
        stats = proxy.stats()
        assert (stats.retries, stats.unreachable) == (1, 1)  # two of the three tried


# -- upstream answers a reverse proxy must not act on ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_answers_that_keep_breaking_off_take_their_backend_out_after_max_failures(stream: bool) -> None:
    # Was never out: the failure streak was reset when the 200's headers came, before the body broke off, so it stood
    # at 1 after every request (6 broken answers in a row, still in rotation).
    async def breaking(request: web.Request) -> web.StreamResponse:
        kind = "text/event-stream" if stream else "application/json"
        answer = web.StreamResponse(status=200, headers={"Content-Type": kind})
        if not stream:
            answer.content_length = 100
        await answer.prepare(request)
        await answer.write(b'data: {"choices": [' if stream else b'{"choices": [')
        assert request.transport is not None
        request.transport.abort()
        return answer

    with (
        backend_serving(breaking) as url,
        Proxy(Router(), [url], max_failures=3, clock=Clock(), base_models=[]) as proxy,
    ):
        for i in range(3):
            with contextlib.suppress(httpx.HTTPError):  # a stream's client sees its connection broken
                post(proxy, {"prompt": f"x{i}", "stream": stream})
            settled(proxy, i + 1)
        assert proxy.stats().backend_error == 3 and proxy.stats().unhealthy == (url,)


_FIRST = bytes(range(256)) * 1024  # 256 KiB: more than the proxy holds before it relays a non-streamed answer
_REST = b"r" * 2**20


def large_answer(
    gate: threading.Event, *, length: bool, breaks_off: bool = False, closed: threading.Event | None = None
) -> Handler:
    """A backend's non-streamed answer of ``_FIRST + _REST`` (with its ``Content-Length`` when ``length``, else
    chunked): it sends ``_FIRST``, waits for ``gate``, then sends the rest, or ``breaks_off`` instead; ``closed`` is
    set when the rest could not be sent, the connection closed."""

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        reply = web.StreamResponse(headers=JSON_BODY)
        if length:
            reply.content_length = len(_FIRST) + len(_REST)
        await reply.prepare(request)
        await reply.write(_FIRST)
        await asyncio.to_thread(gate.wait)
        if breaks_off:
            assert request.transport is not None
            request.transport.abort()
            return reply
        try:
            for start in range(0, len(_REST), 2**16):
                await reply.write(_REST[start : start + 2**16])
        except ConnectionError:
            if closed is not None:
                closed.set()
            return reply
        await reply.write_eof()
        return reply

    return answer


def first_part(reply: httpx.Response) -> tuple[bytes, Iterator[bytes]]:
    """The body's bytes of ``reply`` up to ``_FIRST``'s length (maybe a little past it), and the rest to read."""
    chunks = reply.iter_raw()
    got = b""
    while len(got) < len(_FIRST):
        got += next(chunks)
    return got, chunks


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
def test_a_large_answer_is_relayed_as_it_comes_with_the_engines_length(length: bool) -> None:
    # Was read whole into memory before a byte of it went on: a 300 MiB answer took the proxy's RSS to ~960 MiB, and
    # the client had nothing (not even the status) until the engine had sent the last byte.
    gate = threading.Event()
    with (
        backend_serving(large_answer(gate, length=length)) as url,
        Proxy(Router(), [url], clock=Clock(), base_models=[]) as proxy,
    ):
        try:
            with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10) as reply:
                assert reply.status_code == 200 and reply.headers["x-prefixroute-backend"] == url
                total = str(len(_FIRST) + len(_REST))
                assert reply.headers.get("content-length") == (total if length else None)
                assert reply.headers.get("transfer-encoding") == (None if length else "chunked")
                got, rest = first_part(reply)  # while the engine holds the rest back
                assert got == _FIRST
                gate.set()
                got += b"".join(rest)
        finally:
            gate.set()
        assert got == _FIRST + _REST
        settled(proxy, 1)
        assert proxy.stats().ok == 1 and proxy.router.stats().in_flight == 0


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
def test_a_large_answer_that_breaks_off_after_its_first_bytes_breaks_the_clients_connection(length: bool) -> None:
    # Relayed as it comes, its status and first bytes are the client's before it breaks off: the client must see an
    # incomplete answer (short of its length, or chunks without their end), and the streak of failures goes on.
    gate = threading.Event()
    with (
        backend_serving(large_answer(gate, length=length, breaks_off=True)) as url,
        Proxy(Router(), [url], max_failures=2, clock=Clock(), base_models=[]) as proxy,
    ):
        try:
            for i in range(2):
                gate.clear()
                with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10) as reply:
                    assert reply.status_code == 200
                    _, rest = first_part(reply)
                    gate.set()
                    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                        b"".join(rest)
                settled(proxy, i + 1)
                assert proxy.stats().unhealthy == (() if i == 0 else (url,))  # two in a row: out
        finally:
            gate.set()
        assert proxy.stats().backend_error == 2 and proxy.router.stats().in_flight == 0


def test_a_client_that_leaves_a_large_answer_midway_ends_its_count_and_the_engines_request() -> None:
    gate, closed = threading.Event(), threading.Event()
    with (
        backend_serving(large_answer(gate, length=True, closed=closed)) as url,
        Proxy(Router(), [url], clock=Clock(), base_models=[]) as proxy,
    ):
        try:
            with httpx.stream("POST", proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10) as reply:
                first_part(reply)
            settled(proxy, 1)  # the client closed its connection mid-answer
            assert proxy.stats().client_disconnect == 1 and proxy.router.stats().in_flight == 0
        finally:
            gate.set()
        assert closed.wait(10), "the engine's connection was not closed: it would go on generating"


def test_a_redirect_is_relayed_to_the_client_not_followed() -> None:
    # Was followed: a 302 turned the POST into a GET (the client got the target's 405), a 307 re-posted the prompt to
    # another server while the router counted it on the routed backend, and /v1/models merged the other server's list.
    other: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        other.append(request.method)
        return web.json_response({"object": "list", "data": [{"id": "not-ours", "object": "model"}]})

    with backend_serving(elsewhere, elsewhere) as target:

        async def redirecting(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(target + request.path)

        async def models(request: web.Request) -> web.Response:
            raise web.HTTPFound(target + request.path)

        with (
            backend_serving(redirecting, models) as url,
            Proxy(Router(), [url], clock=Clock(), base_models=[]) as proxy,
        ):
            reply = post(proxy, {"prompt": "x"})
            assert (reply.status_code, reply.headers["Location"]) == (307, target + "/v1/completions")
            assert httpx.get(proxy.url + "/v1/models", timeout=10).status_code == 502
            settled(proxy, 1)
            assert other == [] and proxy.router.stats().in_flight == 0


def test_a_cookie_one_clients_answer_set_is_not_sent_with_anothers_requests() -> None:
    # Was: aiohttp's cookie jar kept it (for a backend named by host, as in production) and sent it with every later
    # request to that backend, whoever's: one user's session with everyone's prompts.
    cookies: list[str | None] = []

    async def setting(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        answer = web.json_response({"choices": [{"text": "ok"}]})
        answer.set_cookie("session", f"secret-{len(cookies)}")
        return answer

    with backend_serving(setting) as url:
        named = url.replace("127.0.0.1", "localhost")
        with Proxy(Router(), [named], clock=Clock(), base_models=[]) as proxy:
            first = post(proxy, {"prompt": "alice"})
            assert first.status_code == 200 and "secret-1" in first.headers["Set-Cookie"]
            assert post(proxy, {"prompt": "bob"}).status_code == 200
    assert cookies == [None, None]


def test_stop_cuts_off_a_request_an_engine_holds_within_seconds_and_ends_its_count(fine: OpenAIEngine) -> None:
    # Was: stop() gave up joining after 10 s with the request still counted (aiohttp's 60 s shutdown timeout, taken
    # twice), and `prefixroute proxy` took 120 s to exit on SIGTERM, past any supervisor's patience.
    fine.stall()
    proxy = Proxy(Router(), [fine.url], clock=Clock(), base_models=[]).start()
    outcome: list[object] = []

    def ask() -> None:
        try:
            outcome.append(post(proxy, {"prompt": "held", "stream": True}).status_code)
        except httpx.HTTPError as exc:
            outcome.append(type(exc))

    client = threading.Thread(target=ask)
    client.start()
    wait_until(lambda: proxy.router.stats().in_flight == 1, what="the request in flight")
    started = time.monotonic()
    proxy.stop()
    took = time.monotonic() - started
    client.join(10)
    assert took < 8.0, took
    assert proxy.router.stats().in_flight == 0 and outcome
