"""Issue 10's HTTP contract, checked as a proxy author writes a client against it: a real ``prefixroute serve`` on
loopback, plain HTTP and UDP, only the names and status codes the issue and docs/adapters.md give (what
test_serve.py already checks is not repeated here)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixroute.adapters.serve.loopback import free_port, start_sidecar

from ..conftest import wait_until
from .conftest import CORPUS, metric_samples

BACKENDS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


class Client:
    """What a proxy author holds: the sidecar's HTTP base URL and its UDP release port."""

    def __init__(self, port: int, release_port: int) -> None:
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
        self.release_port = release_port

    def route(self, **body: Any) -> dict[str, Any]:
        reply = self.http.post("/route", json=body)
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        return answer

    def metrics(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Every sample of ``GET /metrics``, parsed as Prometheus does: name -> labels -> value."""
        return metric_samples(self.http.get("/metrics"))

    def in_flight(self) -> float:
        return sum(self.metrics()["prefixroute_in_flight"].values())

    def send_udp(self, datagram: bytes) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(datagram, ("127.0.0.1", self.release_port))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Client]:
    """One sidecar for the module: two fixed backends, a model folder with a chat template, a UDP release port."""
    folder = model_dir
    port, release_port = free_port(), free_port(socket.SOCK_DGRAM)
    options = ["--tokenizer", str(folder), "--release-port", str(release_port)]
    with start_sidecar(tmp_path_factory.mktemp("sidecar"), BACKENDS, port=port, options=options):
        client = Client(port, release_port)
        with client.http:
            yield client


WRONG_CONTENTS: list[object] = [3, {"text": "hi"}, [1, 2], [{"type": "text", "text": 5}], True]


@pytest.mark.parametrize("content", WRONG_CONTENTS)
@pytest.mark.parametrize(("path", "extra"), [("/route", {}), ("/v1/chat/completions", {"model": "m"})])
def test_a_chat_message_content_of_the_wrong_type_is_a_400_naming_the_field(
    client: Client, path: str, extra: dict[str, Any], content: object
) -> None:
    before = client.in_flight()
    reply = client.http.post(path, json={"messages": [{"role": "user", "content": content}], **extra})
    assert reply.status_code == 400, reply.text
    assert "$.messages[0].content" in reply.json()["error"]
    assert client.in_flight() == before


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "count the rows"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function"}]},
        {"role": "assistant", "tool_calls": [{"id": "call-1", "type": "function"}]},
    ],
)
def test_every_content_openai_allows_still_routes(client: Client, message: dict[str, Any]) -> None:
    answer = client.route(messages=[{"role": "system", "content": CORPUS[0]}, message])
    assert answer["prompt_tokens"] > 0
    assert client.http.post("/finish", json={"id": answer["id"]}).status_code == 200


def test_an_unknown_path_names_every_endpoint_including_the_openai_ones(client: Client) -> None:
    reply = client.http.post("/v1/embeddings", json={"input": "x"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    for endpoint in ("/route", "/first_token", "/finish", "/v1/completions", "/v1/chat/completions", "/metrics",
                     "/healthz"):  # fmt: skip
        assert endpoint in error, endpoint


def test_the_answer_has_exactly_the_contracts_fields_with_their_types(client: Client) -> None:
    for body in ({"prompt_token_ids": list(range(40))}, {"prompt": CORPUS[1]},
                 {"messages": [{"role": "user", "content": CORPUS[0]}], "model": "m", "lease": 30},
                 {"prompt_token_ids": [1, 2, 3], "backends": ["http://127.0.0.1:9003"]}):  # fmt: skip
        answer = client.route(**body)
        assert set(answer) == {"id", "backend", "matched_tokens", "prompt_tokens", "reason"}
        assert all(isinstance(answer[k], str) for k in ("id", "backend", "reason"))
        assert all(type(answer[k]) is int for k in ("matched_tokens", "prompt_tokens"))
        assert 0 <= answer["matched_tokens"] <= answer["prompt_tokens"]
        assert client.http.post("/finish", json={"id": answer["id"]}).json() == {"id": answer["id"]}


def test_nginx_and_haproxy_release_lines_release_and_junk_datagrams_are_counted_and_change_nothing(
    client: Client,
) -> None:
    before = client.metrics()
    decisions = [client.route(prompt_token_ids=[7, 7, 7, i])["id"] for i in range(4)]
    assert client.in_flight() == sum(before["prefixroute_in_flight"].values()) + 4
    for junk in (b"", b"\xff" * 300, b"prefixroute_finish=", b"prefixroute_finish=-", b"<190>", b"x" * 60_000,
                 b"prefixroute_finish=\xff\xfe status=200", "prefixroute_finish=\u00e9".encode()):  # fmt: skip
        client.send_udp(junk)
    client.send_udp(f"<190>Dec  1 08:13:13 prefixroute: prefixroute_finish={decisions[0]} status=200".encode())
    client.send_udp(f"<190>Dec  1 08:13:13 web1 prefixroute: prefixroute_finish={decisions[1]} status=499".encode())
    haproxy = "<190>Dec  1 08:13:13 haproxy[123]: prefixroute_finish={} status=200 bytes=1234 duration_ms=5\n"
    client.send_udp(haproxy.format(decisions[2]).encode())
    client.send_udp(f"<190>1 2024-12-01T08:13:13Z host haproxy 1 - - prefixroute_finish={decisions[3]}".encode())
    wait_until(lambda: client.in_flight() == sum(before["prefixroute_in_flight"].values()), what="UDP releases")
    after = client.metrics()
    released = after["prefixroute_releases_total"][(("path", "udp"),)]
    assert released - before["prefixroute_releases_total"][(("path", "udp"),)] == 4  # the junk released nothing
    assert after["prefixroute_unknown_finishes_total"] == before["prefixroute_unknown_finishes_total"]
    # Each junk datagram without a token is counted (nginx's "-", an unrouted request's line, is read: not junk).
    unread = "prefixroute_release_datagrams_unread_total"
    assert after[unread][()] - before[unread][()] == 7


def test_metrics_parse_as_prometheus_with_every_family_the_issue_lists(client: Client) -> None:
    answer = client.route(prompt_token_ids=list(range(60, 100)))
    client.http.post("/finish", json={"id": answer["id"]})
    client.http.post("/finish", json={"id": "never-issued"})
    samples = client.metrics()
    reasons = {dict(labels)["reason"] for labels in samples["prefixroute_decisions_total"]}
    assert {"prefix", "miss", "load-fallback"} <= reasons
    assert set(samples["prefixroute_in_flight"]) >= {(("backend", backend),) for backend in BACKENDS}
    for name in ("prefixroute_hit_tokens_total", "prefixroute_leases_expired_total",
                 "prefixroute_unknown_finishes_total", "prefixroute_decision_seconds_count"):  # fmt: skip
        assert name in samples, name
    assert samples["prefixroute_unknown_finishes_total"][()] >= 1
    assert samples["prefixroute_decision_seconds_bucket"][(("le", "+Inf"),)] >= 1


def test_a_json_body_with_a_byte_order_mark_is_read(client: Client) -> None:
    """RFC 8259 lets a parser ignore a UTF-8 BOM, and vLLM's does: so do the sidecar's JSON bodies (they were 400)."""
    for path, body in [("/route", {"prompt_token_ids": [1, 2, 3]}), ("/v1/completions", {"prompt": [1, 2, 3]})]:
        content = b"\xef\xbb\xbf" + json.dumps(body).encode()
        reply = client.http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, reply.text
        decision = reply.json()["id"] if path == "/route" else reply.headers["X-Prefixroute-Id"]
        assert client.http.post("/finish", json={"id": decision}).status_code == 200
