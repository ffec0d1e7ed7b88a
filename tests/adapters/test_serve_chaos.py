"""``prefixroute serve`` under seeded chaos: a few hundred concurrent clients a seed route requests in every form the
contract takes (``/route`` with token ids, text or chat, a model, a lease, backends of its own; the pick mode's
forwarded OpenAI completion and chat bodies, batches included; bodies long enough to be tokenized on a worker thread),
report first tokens and finishes over HTTP and as UDP log lines (some twice, some refused, some never, so that only
the lease ends them, some naming no decision at all), leave before the body is sent, right after it, or after the
status line, and send hostile bodies, methods and paths in between. Meanwhile the fleet changes under the sidecar as
``--metrics-from-backends`` and ``--kv-events`` change it (health, capacity, engine load, KV blocks stored, evicted
and cleared), per-request backends past the sidecar's cap are forgotten, and the router's clock steps past the short
leases.

At the end the books must balance exactly: once every lease has run out nothing is in flight, pending prefill or held
on any backend (``/stats``, ``/metrics`` and the policy's view alike); every client that stayed got one well-formed
answer (status, fields and headers as the contract gives them, nothing after it); every decision ended exactly once
(finished, expired, or finished by the sidecar itself for a client that left while its long prompt was tokenized);
every report that found no request in flight was counted as unknown, and no other; each refused request was counted
under its status and nowhere else; the index's invariants hold; ``/metrics`` reads as Prometheus text throughout.

Which stories and which faults come when is drawn from one seeded ``random.Random`` before the run; only their
interleaving is left to the scheduler, and the assertions hold for any interleaving. A client that leaves right after
sending a whole request may or may not have been read (uvicorn hands the app a disconnect when it sees the close
first: both are right), so the books bound exactly what such requests can change, and no more.

The sidecar runs in this process, on uvicorn with httptools and uvloop as ``prefixroute serve`` runs it, with its UDP
release listener; its router has a fake clock (leases end when the test says) and its invariants are checked in the
middle of the run and at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvicorn
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from prefixroute import BlockHash, Router, policy_from_name
from prefixroute.adapters.serve import PromptEncoder, Sidecar, upstream_of
from prefixroute.adapters.serve import app as serve_app
from prefixroute.adapters.serve.release import ReleaseProtocol

from ..conftest import FakeClock, wait_until
from .conftest import CORPUS, tool_call_conversation
from .test_serve_contract_blackbox import parse_exposition

FIXED = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]  # the sidecar only decides: nothing listens there
OWN = [f"http://10.1.0.{i}:8000" for i in range(8)] + ['odd"quote', "odd\\slash", "odd\nline", "odd é"]
SEEN_CAP = 6  # per-request backends the sidecar keeps (4096 in production): a run forgets idle ones many times
BLOCK = 4
LEASE_S = 60.0  # the sidecar's --lease
LONG_LEASES: list[float | None] = [None, 45.0, 1e9]  # a /route body's own: none, shorter, cut to LEASE_S
SHORT_LEASE_S = 0.25  # shorter than a clock step: such a request may expire while its client still reports
STEP_S = 1.0
MAX_STEPS = 8  # the clock moves at most 8 s in a run: no long lease runs out before the end
MAX_BODY = 256 * 2**10
STORIES = 240
RUN_S = 1.5  # stories start over this long
CLIENT_TIMEOUT_S = 20.0
WORDS = sorted({word for line in CORPUS for word in line.replace(";", " ").split()})
SYSTEMS = [" ".join(random.Random(s).choices(WORDS, k=30)) for s in range(4)]  # shared prefixes
REASONS = {"prefix", "load-fallback", "miss", "policy"}
# How a client behaves: it reads its answer on a keep-alive connection ("read", aiohttp's), or on a connection of its
# own it reads it to the end ("raw"), sends the body in parts ("trickle") or chunked, sends a second request right
# behind it ("pipelined"), reads only the status line and headers, leaves mid-body, or leaves right after the body.
LEAVES = ["read"] * 5 + ["raw", "trickle", "chunked", "pipelined", "status", "mid-body", "after-body"]
SEEDS = [(101, "predicted-ttft", None), (202, "bounded-load", ["fake-model", "lora-a"]), (303, "cost-aware", None)]


def hostile(models: list[str] | None) -> list[tuple[str, str, bytes, int]]:
    """(method, path, body, the status the contract answers it with): bad bodies, methods, paths and sizes."""
    deep = b"[" * 5000 + b"]" * 5000
    calls = [("POST", "/route", body, 400) for body in (
        b"{", b"[1, 2]", b"{}", b"null", b'{"prompt_token_ids": []}', b'{"prompt_token_ids": [1, true]}',
        b'{"prompt_token_ids": [1, -1]}', b'{"prompt_token_ids": [100000]}', b'{"prompt_token_ids": [1], "lease": 0}',
        b'{"prompt_token_ids": [1], "lease": 1e400}', b'{"prompt_token_ids": [1], "backends": []}',
        b'{"prompt_token_ids": [1], "backends": ["a", "a"]}', b'{"prompt_token_ids": [1], "prompt": "x"}',
        b'{"prompt": "\\ud800"}', deep, b'{"messages": [{"role": 5, "content": "x"}]}',
        b'{"messages": [{"role": "user", "content": [{"type": null, "text": "x"}]}]}',
    )]  # fmt: skip
    calls += [("POST", "/v1/completions", body, 400) for body in (
        b'{"prompt": ""}', b'{"prompt": [1, -2]}', b"null", b'{"prompt": "x", "model": 5}', deep)]  # fmt: skip
    calls += [("POST", "/v1/chat/completions", body, 400) for body in (b'{"messages": "hi"}', b'{"messages": []}')]
    calls += [("POST", "/finish", body, 400) for body in (b'{"id": 7}', b"{}", b'{"id": "a", "refused": "yes"}')]
    calls += [("POST", "/first_token", b"[]", 400), ("POST", "/route", b"{" + b" " * (MAX_BODY + 10) + b"}", 413)]
    calls += [("GET", "/route", b"", 405), ("PUT", "/finish", b"{}", 405), ("POST", "/metrics", b"", 405),
              ("POST", "/nope", b"{}", 404), ("GET", "/v1/models", b"", 404)]  # fmt: skip
    if models is not None:
        calls.append(("POST", "/route", b'{"prompt_token_ids": [1], "model": "not-served"}', 404))
    return calls


# -- the plan ---------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """A first token or finish a client reports for its decision."""

    what: str  # "first_token" | "finish"
    leave: str  # over HTTP: "read", "raw", "chunked", "status", "mid-body" or "after-body" (LEAVES)
    refused: bool
    pause_s: float


@dataclass
class Story:
    """One client's part in the run: a call, and for a decision what it reports."""

    at_s: float
    kind: str  # "decide", "hostile", "unknown" (a report naming no decision), "udp-junk", "look"
    method: str
    path: str
    body: bytes
    leave: str  # how the client behaves for its first call (LEAVES)
    abort: bool  # leaves with a reset rather than a FIN
    expect: bool  # sends "Expect: 100-continue" and waits for the 100 before the body
    linger_s: float  # how long a client that leaves without its answer stays before it goes
    status: int = 200  # what a client that stays must get
    prompt_tokens: int = 0  # a decision's prompt, in tokens
    backends: tuple[str, ...] = ()  # where a decision may go
    short: bool = False  # a lease shorter than a clock step
    long: bool = False  # a body the sidecar tokenizes on a worker thread
    reports: list[Report] = field(default_factory=list)  # over HTTP, in order
    udp: list[tuple[str, bool]] = field(default_factory=list)  # then one log line: (what, refused)


def plan_stories(rng: random.Random, encoder: PromptEncoder, models: list[str] | None) -> list[Story]:
    max_id = encoder.max_token_id
    system_ids = [[rng.randrange(max_id + 1) for _ in range(24)] for _ in SYSTEMS]
    named = models or ["fake-model", "lora-a", "another-model"]
    hostiles = hostile(models)
    stories = []
    for _ in range(STORIES):
        at = rng.uniform(0.0, RUN_S)
        roll = rng.random()
        if roll < 0.12:
            method, path, body, status = rng.choice(hostiles)
            leave = "raw" if rng.random() < 0.3 else "read"
            stories.append(Story(at, "hostile", method, path, body, leave, False, False, 0.0, status))
            continue
        if roll < 0.17:
            path = rng.choice(["/metrics", "/stats", "/healthz"])
            stories.append(Story(at, "look", rng.choice(["GET", "GET", "HEAD"]), path, b"", "read", False, False, 0.0))
            continue
        if roll < 0.22:  # a report naming no decision, or a log line releasing nothing
            path = rng.choice(["/finish", "/first_token"])
            if rng.random() < 0.5:
                unknown = rng.choice([f"never-issued-{rng.randrange(10**6)}", "", "é☃", "x" * 5000, "000000000000-1"])
                stories.append(Story(at, "unknown", "POST", path, json.dumps({"id": unknown}).encode(),
                                     rng.choice(["read", "raw"]), False, rng.random() < 0.3, 0.0))  # fmt: skip
            else:
                line = f"prefixroute_{path[1:]}=never-issued-{rng.randrange(10**6)}".encode()
                kind = rng.choice(["unknown", "udp-junk"])
                stories.append(Story(at, kind, "UDP", path, line, "read", False, False, 0.0))
            continue
        model = rng.choice([None, *named])
        system = rng.randrange(len(SYSTEMS))
        question = " ".join(rng.choices(WORDS, k=rng.randrange(1, 12)))
        form = rng.choice(["long-text", "long-chat"] if rng.random() < 0.06 else
                          ["ids", "ids", "text", "chat", "chat-parts"])  # fmt: skip
        text = f"{SYSTEMS[system]} {question}"
        if form.startswith("long"):
            # Over 64 KiB, tokenized on a worker thread; words drawn anew, so no piece of it is cached there.
            text = f"{SYSTEMS[system]} " + " ".join(rng.choices(WORDS, k=rng.randrange(12_000, 30_000)))
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEMS[system]},
                                          {"role": "user", "content": text.removeprefix(SYSTEMS[system])}]  # fmt: skip
        if form == "chat-parts":
            messages = [*tool_call_conversation(), {"role": "user", "content": [{"text": question}]}]
        ids = [*system_ids[system], *(rng.randrange(max_id + 1) for _ in range(rng.randrange(1, 30)))]
        if form == "ids":
            prompt_tokens = len(ids)
        elif "chat" in form:
            prompt_tokens = len(encoder.encode_chat(messages))
        else:
            prompt_tokens = len(encoder.encode(text))
        body_fields: dict[str, Any] = {}
        if model is not None:
            body_fields["model"] = model
        short = False
        if rng.random() < 0.5:  # the sidecar's own /route body
            path, backends = "/route", tuple(FIXED)
            key = {"ids": "prompt_token_ids", "text": "prompt", "long-text": "prompt"}.get(form, "messages")
            body_fields[key] = ids if form == "ids" else text if key == "prompt" else messages
            short = not form.startswith("long") and rng.random() < 0.25
            lease = SHORT_LEASE_S if short else rng.choice(LONG_LEASES)
            if lease is not None or rng.random() < 0.2:
                body_fields["lease"] = lease
            if rng.random() < 0.35:
                backends = tuple(rng.sample(OWN + FIXED[:1], rng.randrange(1, 5)))  # a fixed one too, at times
                body_fields["backends"] = list(backends)
            if rng.random() < 0.1:
                body_fields["extra"] = {"unknown": ["fields", "are", "ignored"]}
        else:  # a client's OpenAI request, forwarded: the pick mode
            backends = tuple(FIXED)
            if "chat" in form:
                path = "/v1/chat/completions"
                body_fields["messages"] = messages
            else:
                path = "/v1/completions"
                prompt: Any = ids if form == "ids" else text
                other = [1, 2, 3] if form == "ids" else "and a second"  # a batch is all ids or all texts, as in vLLM
                body_fields["prompt"] = [prompt, other] if rng.random() < 0.15 else prompt  # a batch: the first
            body_fields.update(max_tokens=16, stream=rng.random() < 0.6, n=rng.choice([1, 1, 2]))
        body = json.dumps(body_fields).encode()
        if rng.random() < 0.05:
            body = b"\xef\xbb\xbf" + body  # a byte-order mark, which JSON readers may skip
        long = len(body) > 64 * 2**10
        assert long == form.startswith("long"), (form, len(body))
        leave = rng.choice(LEAVES + ["after-body"] * 4 if long else LEAVES)  # leaving while it is tokenized
        story = Story(at, "decide", "POST", path, body, leave, rng.random() < 0.3, rng.random() < 0.2,
                      rng.uniform(0.0, 0.03), 200, prompt_tokens, backends, short, long)  # fmt: skip
        plan_reports(rng, story)
        stories.append(story)
    return stories


def plan_reports(rng: random.Random, story: Story) -> None:
    """What the client reports once it knows its decision's id. A request with a short lease reports at most one
    finish (it may have expired by then: the finish then counts as unknown, whichever comes first). A client leaves
    right after sending a report (read or not) only for its one and last finish, and a UDP line comes last: so each
    report that is surely applied finds its request in a state the plan knows."""
    if story.short:
        if rng.random() < 0.7:
            if rng.random() < 0.3:
                story.udp = [("finish", rng.random() < 0.2)]
            else:
                story.reports = [Report("finish", rng.choice(["read", "raw", "status"]), False, rng.uniform(0, 0.02))]
        return
    for _ in range(rng.choice([0, 1, 2, 2, 3])):
        what = rng.choice(["first_token", "finish", "finish"])
        leave = rng.choice(["read", "read", "read", "raw", "chunked", "status", "mid-body"])
        story.reports.append(Report(what, leave, rng.random() < 0.15, rng.uniform(0, 0.03)))
    if rng.random() < 0.25:
        story.udp = [(rng.choice(["first_token", "finish"]), rng.random() < 0.2) for _ in range(rng.randrange(1, 3))]
    elif rng.random() < 0.15 and not any(r.what == "finish" and r.leave != "mid-body" for r in story.reports):
        story.reports.append(Report("finish", "after-body", False, rng.uniform(0, 0.02)))


@dataclass
class Fault:
    at_s: float
    kind: str
    backend: str
    value: int


SIDECAR_FAULTS = ("step", "health", "health", "capacity", "load", "store", "store", "evict", "clear", "check")


def plan_faults(
    rng: random.Random,
    *,
    kinds: Sequence[str] = SIDECAR_FAULTS,
    backends: Sequence[str] = (*FIXED, *OWN[:3]),
    run_s: float = RUN_S,
) -> list[Fault]:
    """The fleet's changes: what --metrics-from-backends (health, engine load, capacity) and --kv-events (blocks
    stored, evicted, cleared on an engine restart) do to the router while it serves, the clock's steps (at most
    MAX_STEPS), and checks of the router's invariants in between; ``kinds`` weighs them by repetition."""
    faults = []
    at, steps = 0.0, 0
    while at < run_s + 0.2:
        at += rng.uniform(0.02, 0.08)
        kind = rng.choice(kinds)
        if kind == "step":
            if steps == MAX_STEPS:
                continue
            steps += 1
        faults.append(Fault(at, kind, rng.choice(backends), rng.randrange(1 << 16)))
    return faults


# -- the sidecar, served as prefixroute serve serves it ---------------------------------------------------------------


class Health:
    """The fixed backends' health as ``Fleet.healthy_backends`` reports it; the chaos changes it (none: fail open)."""

    def __init__(self) -> None:
        self.up = frozenset(FIXED)

    def __call__(self, backends: Any) -> list[str]:
        return [backend for backend in backends if backend in self.up]


@dataclass
class Serving:
    server: uvicorn.Server
    port: int
    release_port: int
    thread: threading.Thread | None = None  # the sidecar's

    def idle(self) -> bool:
        """No connection open and no request being served: every request the sidecar was sent is settled."""
        state = self.server.server_state
        return not state.connections and not state.tasks


@contextlib.contextmanager
def serving(sidecar: Sidecar) -> Iterator[Serving]:
    """The sidecar on uvicorn with httptools and uvloop, configured as ``prefixroute serve`` configures it, with its
    UDP release listener, on a thread of its own."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    release = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    release.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        sidecar, http="httptools", lifespan="off", access_log=False, log_level="warning", ws="none",
        timeout_keep_alive=75, backlog=4096, proxy_headers=False, server_header=False, date_header=False,
    )  # fmt: skip
    served = Serving(uvicorn.Server(config), listener.getsockname()[1], release.getsockname()[1])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: ReleaseProtocol(sidecar), sock=release)
        try:
            await served.server.serve(sockets=[listener])
        finally:
            transport.close()

    served.thread = thread = threading.Thread(target=uvloop.run, args=(main(),), name="sidecar", daemon=True)
    thread.start()
    wait_until(lambda: served.server.started, what="the sidecar to listen")
    try:
        yield served
    finally:
        served.server.should_exit = True
        thread.join(10)
        listener.close()
        release.close()


# -- the clients ------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes | None  # None: the client left after the status line


@dataclass
class Books:
    """What the clients know, from which the sidecar's counters follow (see the end of the test)."""

    learned: set[str] = field(default_factory=set)  # decision ids the clients read
    lost: int = 0  # decisions answered to clients that left after the status line of /route (the id unread)
    may_be_lost: int = 0  # decisions asked for by clients that left right after sending the whole request
    may_self_finish: int = 0  # of those, long prompts: the sidecar finishes one it decided for a client gone
    sure_reports: int = 0  # lifecycle reports over HTTP answered (so applied)
    racy_finishes: int = 0  # finishes whose client left right after sending them (applied or not)
    udp_tokens: int = 0  # release tokens sent in UDP log lines
    unknown: int = 0  # reports surely applied to ids no decision had
    ignored: int = 0  # reports surely applied to learned ids no longer in flight (long leases)
    unfinished: int = 0  # learned ids (long leases) without a finish surely applied
    short_balance: int = 0  # over learned ids with a short lease: finishes surely applied, less one each
    refused: Counter[int] = field(default_factory=Counter)  # 4xx and 5xx answers, by status
    problems: list[str] = field(default_factory=list)


class Client:
    def __init__(self, session: aiohttp.ClientSession, serving: Serving, books: Books, started: float) -> None:
        self.session = session
        self.port = serving.port
        self.release = ("127.0.0.1", serving.release_port)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.setblocking(False)
        self.books = books
        self.started = started

    async def call(self, method: str, path: str, body: bytes, leave: str, *, abort: bool = False,
                   expect: bool = False, linger_s: float = 0.0) -> Answer | None:  # fmt: skip
        """Send one request and behave as ``leave`` says; the answer, or None when the client left before it."""
        if leave == "read":
            headers = {"Content-Type": "application/json"}
            async with self.session.request(method, f"http://127.0.0.1:{self.port}{path}", data=body,
                                            headers=headers) as response:  # fmt: skip
                raw = await response.read()
                return Answer(response.status, {k.lower(): v for k, v in response.headers.items()}, raw)
        connection = Connection(await self.connect())
        try:
            head = (f"{method} {path} HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n")  # fmt: skip
            if leave == "pipelined":  # and a second request right behind it, on the same connection
                await connection.send(f"{head}\r\n".encode() + body + b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n"
                                      b"Connection: close\r\n\r\n")  # fmt: skip
                answer, rest = one_answer(await connection.to_end())
                health, rest = one_answer(rest)
                assert health.status == 200 and not rest, (health, rest[:200])
                return answer
            head += "Connection: close\r\n"
            if leave == "chunked":  # no Content-Length: the body in three chunks, a moment apart
                head = head.replace(f"Content-Length: {len(body)}", "Transfer-Encoding: chunked")
                await connection.send(f"{head}\r\n".encode())
                third = -(-len(body) // 3)
                for start in range(0, len(body), third):
                    part = body[start : start + third]
                    await connection.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                    await asyncio.sleep(0.003)
                await connection.send(b"0\r\n\r\n")
                answer, rest = one_answer(await connection.to_end())
                assert not rest, f"more than one answer: {rest[:200]!r}"
                return answer
            await connection.send(f"{head}Expect: 100-continue\r\n\r\n".encode() if expect else f"{head}\r\n".encode())
            if expect:  # the sidecar's handler reads the body, so uvicorn asks for it
                interim = await connection.head()
                assert interim.startswith(b"HTTP/1.1 100 "), interim
            if leave == "mid-body":
                await connection.send(body[: len(body) // 2])
                await asyncio.sleep(linger_s)
                return None
            if leave == "trickle":  # the body in three pieces, a moment apart: the sidecar reads it in parts
                for part in (body[: len(body) // 3], body[len(body) // 3 : -1]):
                    await connection.send(part)
                    await asyncio.sleep(0.005)
                body = body[-1:]
            await connection.send(body)
            if leave == "after-body":
                await asyncio.sleep(linger_s)  # a long prompt may be being tokenized now
                return None
            if leave == "status":
                return Answer(*parse_head(await connection.head()), None)
            answer, rest = one_answer(await connection.to_end())  # Connection: close
            assert not rest, f"more than one answer: {rest[:200]!r}"
            return answer
        finally:
            connection.close(abort=abort)

    async def connect(self) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def story(self, story: Story) -> None:
        await asyncio.sleep(max(0.0, story.at_s - (time.monotonic() - self.started)))
        try:
            if story.kind == "decide":
                await self.decide(story)
            elif story.method == "UDP":
                self.send_udp(story)
            else:
                answer = await self.call(story.method, story.path, story.body, story.leave, expect=story.expect)
                assert answer is not None and answer.body is not None
                self.check(story, answer)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with the run's books
            when = time.monotonic() - self.started
            self.books.problems.append(
                f"{story.kind} {story.method} {story.path} {story.body[:60]!r} leave={story.leave} at {when:.2f} s: "
                f"{exc!r}"
            )

    def send_udp(self, story: Story) -> None:
        if story.kind == "unknown":
            self.udp.sendto(b"<190>nginx: POST /v1/completions " + story.body + b" status=200", self.release)
            self.books.udp_tokens += 1
            self.books.unknown += 1
        else:  # lines that release nothing: no token, nginx's "-" for a request not routed, bytes
            for junk in (b"<190>nginx: GET /v1/models 200", b"prefixroute_finish=- status=400", b"\xff\x00\n\n"):
                self.udp.sendto(junk, self.release)

    def check(self, story: Story, answer: Answer) -> None:
        """A hostile call's answer is its status with ``{"error": str}`` (405: and Allow); a look's is its data."""
        assert answer.body is not None
        if story.kind == "hostile":
            assert answer.status == story.status, (answer.status, answer.body[:200])
            assert answer.headers["content-type"] == "application/json", answer.headers
            error = json.loads(answer.body)
            assert set(error) == {"error"} and isinstance(error["error"], str) and error["error"], error
            if answer.status == 405:
                assert answer.headers["allow"] in ("POST", "GET, HEAD"), answer.headers
            self.books.refused[answer.status] += 1
        elif story.kind == "unknown":
            assert answer.status == 200 and json.loads(answer.body) == json.loads(story.body), answer
            self.books.sure_reports += 1
            self.books.unknown += 1
        else:  # a look
            assert answer.status == 200, answer
            if story.method == "HEAD":
                assert answer.body == b""
            elif story.path == "/metrics":
                samples = parse_exposition(answer.body.decode())
                assert all(v >= 0 for (name, _), v in samples.items() if name == "prefixroute_in_flight"), samples
            elif story.path == "/stats":
                stats = json.loads(answer.body)
                assert set(stats) == {"decisions", "in_flight", "in_flight_total", "leases_expired",
                                      "unknown_finishes", "releases", "release_datagrams_unread",
                                      "bad_requests"}, stats  # fmt: skip
                assert stats["in_flight_total"] >= 0 and min(stats["in_flight"].values()) >= 0, stats
            else:
                health = json.loads(answer.body)  # with a health filter, the healthy ones too (liveness: 200)
                assert {k: v for k, v in health.items() if k != "healthy_backends"} == {
                    "status": "ok",
                    "backends": FIXED,
                }
                assert set(health.get("healthy_backends", FIXED)) <= set(FIXED), health

    async def decide(self, story: Story) -> None:
        books = self.books
        answer = await self.call(story.method, story.path, story.body, story.leave, abort=story.abort,
                                 expect=story.expect, linger_s=story.linger_s)  # fmt: skip
        if answer is None:
            if story.leave == "after-body":
                books.may_be_lost += 1
                books.may_self_finish += story.long
            return
        assert answer.status == 200, (answer.status, answer.body)
        if answer.body is None and story.path == "/route":
            books.lost += 1  # decided and answered: the client read no further than the status
            return
        decision_id = check_decision(story, answer)
        assert decision_id not in books.learned, f"decision id {decision_id} given twice"
        books.learned.add(decision_id)
        live = True  # whether the request is in flight, as far as the reports surely applied go
        for report in story.reports:
            await asyncio.sleep(report.pause_s)
            body = json.dumps({"id": decision_id, **({"refused": True} if report.refused else {})}).encode()
            path = f"/{report.what}"
            reply = await self.call("POST", path, body, report.leave, abort=story.abort, expect=story.expect,
                                    linger_s=report.pause_s)  # fmt: skip
            if report.leave == "after-body":
                books.racy_finishes += 1
            if reply is None:
                continue
            assert reply.status == 200, (path, reply)
            assert reply.body is None or json.loads(reply.body) == {"id": decision_id}, reply
            books.sure_reports += 1
            if story.short:
                books.short_balance += 1
            else:
                books.ignored += not live
                live = live and report.what != "finish"
        if story.udp:
            await asyncio.sleep(0.005)
            tokens = " ".join(f"prefixroute_{what}={decision_id}" for what, _ in story.udp)
            status = 400 if any(refused for _, refused in story.udp) else rng_status(decision_id)
            self.udp.sendto(f"<190>nginx: POST {story.path} {tokens} status={status}".encode(), self.release)
            books.udp_tokens += len(story.udp)
            for what, _ in story.udp:
                if story.short:
                    books.short_balance += 1
                else:
                    books.ignored += not live
                    live = live and what != "finish"
        if story.short:
            books.short_balance -= 1
        else:
            books.unfinished += live


class Connection:
    """A client's own TCP connection, on a plain socket: what the sidecar sent stays readable after a reset that
    follows it (an asyncio stream drops it), as for the HTTP clients a gateway uses."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.buffer = b""

    async def send(self, data: bytes) -> None:
        """Send ``data``; a sidecar that has answered and closed may refuse the rest (its answer is still read)."""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await self.loop.sock_sendall(self.sock, data)

    async def more(self) -> bool:
        """Read what comes next into the buffer; False at the end of the connection (closed, or reset after it)."""
        try:
            chunk = await asyncio.wait_for(self.loop.sock_recv(self.sock, 65536), CLIENT_TIMEOUT_S)
        except ConnectionResetError:
            return False
        self.buffer += chunk
        return bool(chunk)

    async def head(self) -> bytes:
        """An answer's status line and headers (the rest stays in the buffer)."""
        while b"\r\n\r\n" not in self.buffer:
            assert await self.more(), f"the connection ended before an answer: {self.buffer[:200]!r}"
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n"

    async def to_end(self) -> bytes:
        while await self.more():
            pass
        return self.buffer

    def close(self, *, abort: bool) -> None:
        if abort:  # a reset rather than a FIN
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def rng_status(decision_id: str) -> int:
    """A status that does not refuse: 200, a timeout, or nginx's 499 for a client gone."""
    return [200, 200, 408, 499][sum(map(ord, decision_id)) % 4]


def check_decision(story: Story, answer: Answer) -> str:
    """The decision's id, once its answer is checked against the contract: the five fields, of their types, and for
    the pick mode the same decision in the headers."""
    headers = answer.headers
    if answer.body is None:  # the pick mode's client read the headers only: the decision is there
        decision = {"id": headers["x-prefixroute-id"], "backend": headers["x-prefixroute-backend"],
                    "matched_tokens": int(headers["x-prefixroute-matched-tokens"]),
                    "prompt_tokens": story.prompt_tokens, "reason": headers["x-prefixroute-reason"]}  # fmt: skip
    else:
        assert headers["content-type"] == "application/json", headers
        decision = json.loads(answer.body)
    assert set(decision) == {"id", "backend", "matched_tokens", "prompt_tokens", "reason"}, decision
    assert isinstance(decision["id"], str) and decision["id"], decision
    assert decision["backend"] in story.backends, (decision, story.backends)
    assert decision["prompt_tokens"] == story.prompt_tokens, (decision, story.prompt_tokens)
    matched = decision["matched_tokens"]
    assert type(matched) is int and 0 <= matched <= story.prompt_tokens and matched % BLOCK == 0, decision
    assert decision["reason"] in REASONS, decision
    if story.path != "/route":
        assert headers["x-accel-redirect"] == "@prefixroute_upstream", headers
        assert headers["x-prefixroute-backend"] == decision["backend"], headers
        assert headers["x-prefixroute-upstream"] == upstream_of(decision["backend"]), headers
        assert headers["x-prefixroute-id"] == decision["id"], headers
        assert headers["x-prefixroute-reason"] == decision["reason"], headers
        assert headers["x-prefixroute-matched-tokens"] == str(matched), headers
    return str(decision["id"])


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), lines[0]
    fields = (line.partition(":") for line in lines[1:] if line)
    return int(lines[0].split()[1]), {name.strip().lower(): value.strip() for name, _, value in fields}


def one_answer(raw: bytes) -> tuple[Answer, bytes]:
    """The first answer in bytes read from a connection (its body Content-Length bytes), and what follows it."""
    while raw.startswith(b"HTTP/1.1 100 "):  # the interim answer to Expect: 100-continue
        raw = raw.split(b"\r\n\r\n", 1)[1]
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, f"no whole answer: {raw[:200]!r}"
    status, headers = parse_head(head + b"\r\n")
    length = int(headers["content-length"])
    assert len(rest) >= length, f"an answer cut short: {raw[:300]!r}"
    return Answer(status, headers, rest[:length]), rest[length:]


async def chaos(faults: list[Fault], router: Router, clock: FakeClock, health: Health,
                chains: list[list[BlockHash]], started: float, log: list[str]) -> None:  # fmt: skip
    """Apply the fleet's changes at their times, from this thread (as Fleet's threads do)."""
    for fault in faults:
        await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - started)))
        log.append(f"{time.monotonic() - started:.3f} {fault.kind} {fault.backend} {fault.value}")
        apply_fault(fault, router, clock, health, chains)


def apply_fault(fault: Fault, router: Router, clock: FakeClock, health: Health, chains: list[list[BlockHash]]) -> None:
    """Change the router as --metrics-from-backends (health, engine load, capacity) and --kv-events (blocks stored,
    evicted, cleared on an engine restart) do, step the clock, or check the router's invariants (under its lock,
    whichever thread writes meanwhile); ``chains`` are the block hashes KV events store and evict. The ext_proc
    chaos test applies its faults with it too."""
    value, backend = fault.value, fault.backend
    if fault.kind == "step":
        clock.tick(STEP_S)
    elif fault.kind == "health":
        health.up = frozenset(b for i, b in enumerate(FIXED) if value >> i & 1)  # none at all: fail open
    elif fault.kind == "capacity":
        router.set_capacity(backend, [2, 8, 64, None][value % 4])
    elif fault.kind == "load":
        router.set_engine_load(backend, queue_len=value % 9 or None, kv_usage=(value % 11) / 10 or None)
    elif fault.kind in ("store", "evict"):
        hashes = chains[value % len(chains)]
        if fault.kind == "store":
            router.store(backend, hashes)
        else:
            router.evict(backend, hashes[value % len(hashes) :])
    elif fault.kind == "clear":
        router.clear_backend(backend)
    else:
        router._check()


async def drive(serving: Serving, stories: list[Story], faults: list[Fault], router: Router, clock: FakeClock,
                health: Health, chains: list[list[BlockHash]], concurrency: int,
                ) -> tuple[Books, list[str]]:  # fmt: skip
    books, log = Books(), list[str]()
    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = Client(session, serving, books, started)
        try:
            fault_task = asyncio.ensure_future(chaos(faults, router, clock, health, chains, started, log))
            await asyncio.gather(*(client.story(story) for story in stories))
            await fault_task
        finally:
            client.udp.close()
    return books, log


# -- the test ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planner(model_dir: Path) -> PromptEncoder:
    """The model's tokenizer as the plan reads it, to know each prompt's length (the sidecar has its own: this one's
    cache of pieces would make the sidecar's long prompts quick to tokenize)."""
    return PromptEncoder(model_dir)


def stats_of(serving: Serving) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", serving.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"GET /stats HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    answer, rest = one_answer(raw)
    assert answer.status == 200 and answer.body is not None and not rest
    stats: dict[str, Any] = json.loads(answer.body)
    return stats


def metrics_of(serving: Serving) -> str:
    with socket.create_connection(("127.0.0.1", serving.port), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    answer, rest = one_answer(raw)
    assert answer.status == 200 and answer.body is not None and not rest
    return answer.body.decode()


@pytest.mark.parametrize(("seed", "policy", "models"), SEEDS, ids=[f"seed{s}-{p}" for s, p, _ in SEEDS])
def test_the_books_balance_after_seeded_chaos(
    seed: int,
    policy: str,
    models: list[str] | None,
    planner: PromptEncoder,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serve_app, "_MAX_SEEN_BACKENDS", SEEN_CAP)
    rng = random.Random(seed)
    stories = plan_stories(rng, planner, models)
    faults = plan_faults(rng)
    concurrency = rng.randrange(16, 49)
    clock, health = FakeClock(1000.0), Health()
    router = Router(block_size=BLOCK, policy=policy_from_name(policy), clock=clock, rng=random.Random(seed))
    base = frozenset({"fake-model"}) if models is None else frozenset()
    sidecar = Sidecar(router, backends=FIXED, encoder=PromptEncoder(model_dir), models=models, base_models=base,
                      lease=LEASE_S, healthy=health, max_body_bytes=MAX_BODY)  # fmt: skip
    with serving(sidecar) as served:
        chains = [router.hasher.hash(planner.encode(system)) for system in SYSTEMS]
        books, log = asyncio.run(drive(served, stories, faults, router, clock, health, chains, concurrency))
        # Every request sent is settled (read and answered, or dropped for a client gone), every datagram applied.
        wait_until(served.idle, what="the sidecar to settle every connection")
        wait_until(lambda: sidecar.metrics.releases.get("udp", 0) >= books.udp_tokens, what="every UDP line")
        before = stats_of(served)
        clock.tick(10 * LEASE_S)  # every lease runs out
        after = stats_of(served)
        metrics = metrics_of(served)
    assert served.thread is not None and not served.thread.is_alive(), "the sidecar did not stop"
    samples = parse_exposition(metrics)
    families = {family.name for family in text_string_to_metric_families(metrics)}
    rstats = router.stats()
    decisions = rstats.decisions
    unread = decisions - len(books.learned) - books.lost  # decided for clients that left right after the request
    racy_applied = after["releases"].get("http", 0) - books.sure_reports  # finishes of clients that left at once
    # Each decision ends once: a finish (a report that finds it gone is unknown), its lease, or the sidecar's own
    # finish for a client that left while its long prompt was tokenized. So, summed: unknown reports less expired
    # leases is what the books say, plus those own finishes (the one figure no client can know).
    expected = (books.ignored + books.unknown - books.unfinished + books.short_balance + racy_applied - unread
                - books.lost)  # fmt: skip
    own_finishes = after["unknown_finishes"] - after["leases_expired"] - expected
    candidates = router.decide([1] * 8, [*FIXED, *OWN]).candidates
    books_by_backend = {c.backend: (c.in_flight, c.pending_prefill_tokens, c.held_blocks, c.active_blocks,
                                    c.in_prefill) for c in candidates}  # fmt: skip
    report = (
        f"seed={seed} policy={policy} models={models} stories={len(stories)} decisions={decisions} "
        f"learned={len(books.learned)} unread={books.lost}+{unread} (of {books.may_be_lost}, {books.may_self_finish} "
        f"long) "
        f"racy finishes {racy_applied} of {books.racy_finishes} own_finishes={own_finishes} "
        f"books={ {k: v for k, v in vars(books).items() if k not in ('learned', 'problems')} } "
        f"before={before} after={after} router={rstats} by_backend={books_by_backend} faults={log[-12:]}"
    )
    print(report)  # shown with -s, and on failure
    assert not books.problems, (books.problems[:5], report)
    assert 0 <= unread <= books.may_be_lost, report
    assert 0 <= racy_applied <= books.racy_finishes, report
    assert after["releases"].get("udp", 0) == books.udp_tokens, report
    assert 0 <= own_finishes <= books.may_self_finish, report
    assert rstats.commits == decisions == sum(after["decisions"].values()), report
    assert after["leases_expired"] - before["leases_expired"] == before["in_flight_total"], report
    assert after["in_flight_total"] == rstats.in_flight == 0 and set(after["in_flight"].values()) == {0}, report
    assert set(books_by_backend.values()) == {(0, 0, 0, 0, 0)}, report
    assert after["bad_requests"] == {str(status): n for status, n in books.refused.items()}, report
    assert {"prefixroute_decisions", "prefixroute_in_flight", "prefixroute_decision_seconds"} <= families, report
    in_flight = {labels: v for (name, labels), v in samples.items() if name == "prefixroute_in_flight"}
    assert len(in_flight) >= len(FIXED) and set(in_flight.values()) == {0.0}, (in_flight, report)
    assert samples[("prefixroute_unknown_finishes_total", ())] == after["unknown_finishes"], report
    router._check()
