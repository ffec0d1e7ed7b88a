"""Issue 10's contract driven as an independent client written from its text would drive it: a real ``prefixroute
serve`` on loopback, plain HTTP, hostile bodies, methods and connections; after each scenario the invariants the
contract promises are checked over HTTP alone: a 4xx whose body is ``{"error": "..."}`` (no traceback), no request
left in flight in ``/metrics``, and the sidecar still routes a good request. (test_serve.py checks the messages of
the common bad bodies in process, test_serve_contract_client.py the answer's fields and the metric families: not
repeated here.)"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixroute.adapters.serve.loopback import free_port, start_sidecar

from .conftest import CORPUS, metric_samples

BACKENDS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]


class Client:
    """What a client written from the contract holds: the sidecar's base URL."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20)

    def samples(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        return metric_samples(self.http.get("/metrics"))

    def in_flight(self) -> float:
        return sum(self.samples()["prefixroute_in_flight"].values())

    def decisions(self) -> float:
        return sum(self.samples()["prefixroute_decisions_total"].values())

    def still_routes(self) -> None:
        """A good request is answered, and its finish brings the count back to 0."""
        answer = self.http.post("/route", json={"prompt_token_ids": [5, 6, 7, 8]})
        assert answer.status_code == 200, answer.text
        assert self.http.post("/finish", json={"id": answer.json()["id"]}).status_code == 200
        assert self.in_flight() == 0


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Client]:
    port = free_port()
    options = ["--tokenizer", str(model_dir)]
    with start_sidecar(tmp_path_factory.mktemp("sidecar"), BACKENDS, port=port, options=options):
        client = Client(port)
        with client.http:
            yield client


def assert_refused(reply: httpx.Response, status: int | None = None) -> None:
    """A client's mistake: a 4xx (``status`` when given) whose JSON body is ``{"error": str}``, no traceback."""
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text)
    assert status is None or reply.status_code == status, (reply.status_code, reply.text)
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert isinstance(error, str) and error and "Traceback" not in error


HOSTILE: list[tuple[str, bytes]] = [
    # bodies that are not a JSON object
    ("/route", b""), ("/route", b"null"), ("/route", b"3"), ("/route", b'"prompt"'), ("/route", b"\xff\xfe{}"),
    ("/first_token", b"[]"), ("/finish", b""), ("/v1/completions", b"null"), ("/v1/chat/completions", b"[]"),
    # JSON's non-numbers and out-of-range numbers
    ("/route", b'{"prompt_token_ids": [NaN]}'), ("/route", b'{"prompt_token_ids": [1], "lease": Infinity}'),
    ("/route", b'{"prompt_token_ids": [1], "lease": 1e400}'), ("/route", b'{"prompt_token_ids": [1], "lease": -1e-9}'),
    ("/route", b'{"prompt_token_ids": [1' + b"0" * 400 + b"]}"), ("/route", b'{"prompt_token_ids": [1.0]}'),
    ("/route", b'{"prompt_token_ids": [18446744073709551616]}'),
    ("/route", b'{"prompt_token_ids": [1], "lease": null}x'),
    # prompts of the wrong shape
    ("/route", b'{"prompt": ["a", "b"]}'), ("/route", b'{"prompt": [[1, 2]]}'), ("/route", b'{"prompt": []}'),
    ("/route", b'{"prompt": ""}'), ("/route", b'{"prompt_token_ids": [[1]]}'), ("/route", b'{"prompt_token_ids": {}}'),
    ("/route", b'{"prompt_token_ids": [200]}'), ("/route", b'{"messages": [1]}'), ("/route", b'{"messages": [[]]}'),
    ("/route", b'{"messages": [{"role": null, "content": "x"}]}'), ("/route", b'{"messages": {"role": "user"}}'),
    ("/route", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("/route", b'{"messages": [{"role": "user", "content": ["x", 7]}]}'),
    # options of the wrong type
    ("/route", b'{"prompt_token_ids": [1], "model": ["m"]}'), ("/route", b'{"prompt_token_ids": [1], "lease": "5"}'),
    ("/route", b'{"prompt_token_ids": [1], "backends": [null]}'),
    ("/route", b'{"prompt_token_ids": [1], "backends": {}}'),
    ("/route", b'{"prompt_token_ids": [1], "backends": ["http://a:1", ""]}'),
    # lifecycle calls
    ("/first_token", b'{"id": 5}'), ("/first_token", b'{"id": null}'), ("/first_token", b'{"ids": "x"}'),
    ("/finish", b'{"id": ["x"]}'), ("/finish", b'{"id": {"id": "x"}}'), ("/finish", b'{"id": "x", "refused": "yes"}'),
    ("/finish", b'{"id": "x", "refused": 1}'),
    # the pick mode: OpenAI requests that are not one
    ("/v1/completions", b'{"prompt": [null, 1]}'), ("/v1/completions", b'{"prompt": [[]]}'),
    ("/v1/completions", b'{"prompt": [1.5]}'), ("/v1/completions", b'{"prompt": {"text": "x"}}'),
    ("/v1/completions", b'{"prompt": [999]}'), ("/v1/completions", b'{"prompt": "x", "model": 7}'),
    ("/v1/chat/completions", b'{"messages": [null]}'), ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}'),
    ("/v1/chat/completions", b'{"prompt": "no messages"}'),
    # nesting and lone surrogates, in each kind of body
    ("/finish", b'{"id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"), ("/first_token", b'{"id": "\\udfff"}'),
]  # fmt: skip


@pytest.mark.parametrize(("path", "raw"), HOSTILE, ids=[f"{p}:{r[:40]!r}" for p, r in HOSTILE])
def test_a_hostile_body_is_a_json_4xx_that_routes_and_releases_nothing(client: Client, path: str, raw: bytes) -> None:
    decisions = client.decisions()
    reply = client.http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_refused(reply, 400)
    assert client.decisions() == decisions
    client.still_routes()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("HEAD", "/route", 405), ("OPTIONS", "/finish", 405), ("DELETE", "/first_token", 405),
     ("PUT", "/v1/completions", 405), ("PATCH", "/healthz", 405), ("POST", "/stats", 405),
     ("HEAD", "/nowhere", 404), ("GET", "/v1/models", 404), ("POST", "/route/", 404)],
)  # fmt: skip
def test_wrong_methods_and_unknown_paths_are_refused_with_allow(
    client: Client, method: str, path: str, status: int
) -> None:
    reply = client.http.request(method, path, json={"prompt_token_ids": [1]} if method != "HEAD" else None)
    assert reply.status_code == status
    if method != "HEAD":
        assert_refused(reply, status)
    if status == 405:
        assert reply.headers["allow"] in ("POST", "GET, HEAD")
    client.still_routes()


def test_a_head_of_metrics_and_healthz_answers_headers_only(client: Client) -> None:
    for path in ("/metrics", "/healthz"):
        reply = client.http.head(path)
        assert reply.status_code == 200 and reply.content == b""


def test_clients_that_leave_midway_under_concurrency_leave_nothing_in_flight(client: Client) -> None:
    """Concurrent clients over real sockets, some served (route or pick, first token, finish twice), some leaving
    midway through their body: once they are gone, nothing is counted in flight. (A client that leaves while its
    long text is tokenized is test_serve.py's, in process, where the moment it leaves is not left to the scheduler.)"""
    rng = random.Random(7)
    errors: list[BaseException] = []

    def request(kind: str, i: int) -> None:
        try:
            if kind == "served":
                with httpx.Client(base_url=client.http.base_url, timeout=20) as mine:
                    path = rng.choice(["/route", "/v1/completions", "/v1/chat/completions"])
                    good = {
                        "/route": {"prompt_token_ids": [i, i + 1, 3]},
                        "/v1/completions": {"prompt": [i, 1, 2]},
                        "/v1/chat/completions": {"messages": [{"role": "user", "content": CORPUS[i % 2]}]},
                    }
                    reply = mine.post(path, json=good[path])
                    assert reply.status_code == 200, reply.text
                    decision = reply.json()["id"]
                    assert mine.post("/first_token", json={"id": decision}).status_code == 200
                    for _ in range(2):  # idempotent
                        assert mine.post("/finish", json={"id": decision}).json() == {"id": decision}
                return
            body = json.dumps({"prompt": CORPUS[0] * (1 + i % 3) * 100}).encode()
            head = f"POST /route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            with socket.create_connection(("127.0.0.1", client.port)) as raw:
                raw.sendall(head.encode() + b"\r\n\r\n" + body[: rng.randrange(len(body))])
                time.sleep(rng.random() * 0.01)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    kinds = ["served", "leaves-mid-body"] * 20
    threads = [threading.Thread(target=request, args=(kind, i)) for i, kind in enumerate(kinds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert client.in_flight() == 0
    client.still_routes()


def test_per_request_backends_are_bounded_so_one_body_cannot_stall_the_sidecar(client: Client) -> None:
    """A body may list backends by the million (32 MiB); routing among them held the event loop for seconds per
    hundred thousand, so every other request waited: past 4096 (the backends the sidecar keeps) it is a 400."""
    many = [f"http://10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:8000" for i in range(4097)]
    reply = client.http.post("/route", json={"prompt_token_ids": [1, 2, 3], "backends": many})
    assert_refused(reply, 400)
    assert "4096" in reply.json()["error"] and "backends" in reply.json()["error"]
    answer = client.http.post("/route", json={"prompt_token_ids": [1, 2, 3], "backends": many[:4096]})
    assert answer.status_code == 200, answer.text
    assert client.http.post("/finish", json={"id": answer.json()["id"]}).status_code == 200
    client.still_routes()


def test_a_json_body_is_read_whatever_content_type_the_client_sends(client: Client) -> None:
    """nginx and HAProxy forward the client's own Content-Type (curl -d sends a form type): the body decides."""
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "application/json; charset=utf-8"):
        headers = {} if content_type is None else {"Content-Type": content_type}
        reply = client.http.post("/route", content=b'{"prompt_token_ids": [1, 2]}', headers=headers)
        assert reply.status_code == 200, (content_type, reply.text)
        client.http.post("/finish", json={"id": reply.json()["id"]})
    client.still_routes()
