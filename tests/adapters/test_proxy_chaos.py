"""``prefixroute proxy`` under seeded chaos: a few hundred concurrent requests (streamed or not; completions of
token ids or text, and chat) from clients that read to the end, leave before the first byte, after a few chunks,
mid-body, time out or never read, while three fake engines fail, refuse and accept again, stall and resume, and one
is stopped and restarted on its port; hostile bodies in between. At the end the books must balance exactly: nothing
in flight, pending prefill or held on any backend, one outcome per request, no client left waiting out its 20 s for an
answer, no finish ignored, the index's invariants intact, and every stream a client read to its end well-formed SSE
ending in ``data: [DONE]``.

Which requests and which faults come when is drawn from one seeded ``random.Random`` before the run; only their
interleaving is left to the scheduler, and the assertions hold for any interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from prefixroute import BoundedLoad, Candidate, Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.testing.openai_engine import OpenAIEngine

ENGINES = 3
TOKENS = 4  # each fake engine's answer, in tokens
TOKEN_DELAY_S = 0.002
REQUESTS = 300
SYSTEMS = [" ".join(f"sys{s}w{i}" for i in range(48)) for s in range(5)]  # shared prefixes, three blocks each
HOSTILE: list[tuple[bytes, dict[str, str]]] = [
    (b"{", {}),
    (b"[1, 2]", {}),
    (b'{"prompt": ""}', {}),
    (b'{"prompt": null}', {}),
    (b'{"prompt": [1, 1.5, 3]}', {}),
    (b'{"prompt": "x", "model": 5}', {}),
    (b'{"prompt": "\\ud800"}', {}),
    (b"[" * 5000 + b"]" * 5000, {}),
    (b'{"prompt": [-1]}', {}),
    (b"\x1f\x8b not gzip at all", {"Content-Encoding": "gzip"}),
]
LEAVES = ["read", "read", "read", "read", "chunks", "before-first-byte", "mid-body", "timeout", "never-read"]


class SlowBoundedLoad(BoundedLoad):
    """The CLI's default policy, holding the proxy's event loop 1 ms per decision (a slow custom policy)."""

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        time.sleep(0.001)
        return super().choose(candidates)


@dataclass
class Spec:
    """One request of the plan."""

    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    leave: str  # how the client behaves (LEAVES)
    hostile: bool
    wait_s: float  # for "timeout" and "never-read": how long it waits before it closes
    chunks: int  # for "chunks": reads before it leaves
    abort: bool  # close with a reset rather than a FIN


@dataclass
class Tally:
    started: float
    sent: int = 0
    hostile: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    whole_streams: int = 0
    whole_ok: int = 0
    bad_sse: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)  # requests that had no answer within the client's timeout


def plan_requests(rng: random.Random) -> list[Spec]:
    specs = []
    for _ in range(REQUESTS):
        if rng.random() < 0.06:
            raw, headers = rng.choice(HOSTILE)
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            specs.append(Spec(path, raw, headers, False, "read", True, 0.0, 0, False))
            continue
        stream = rng.random() < 0.6
        system = rng.choice(SYSTEMS)
        question = " ".join(f"q{rng.randrange(1000)}" for _ in range(rng.randrange(1, 20)))
        kind = rng.choice(["ids", "text", "chat"])
        body: dict[str, Any] = {"model": "fake-model", "stream": stream}
        if kind == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        else:
            path = "/v1/completions"
            text = f"{system} {question}"
            body["prompt"] = [hash_word(word) for word in text.split()] if kind == "ids" else text
        if stream and rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.2:
            body["n"] = 2
        leave = rng.choice(LEAVES)
        specs.append(
            Spec(
                path,
                json.dumps(body).encode(),
                {},
                stream,
                leave,
                False,
                rng.uniform(0.0, 0.06),
                rng.randrange(1, 4),
                rng.random() < 0.3,
            )  # fmt: skip
        )
    return specs


def hash_word(word: str) -> int:
    return int(sum(ord(c) * 31**i for i, c in enumerate(word)) % 50_000) + 1


@dataclass
class Fault:
    at_s: float
    kind: str
    engine: int
    count: int = 1
    hold_s: float = 0.0
    other: int = 0


def plan_faults(rng: random.Random, duration_s: float) -> list[Fault]:
    faults = []
    at = 0.0
    while at < duration_s:
        at += rng.uniform(0.05, 0.25)
        kind = rng.choice(["fail", "fail", "refuse", "stall", "refuse-two", "fail-after-refuse"])
        engine = rng.randrange(ENGINES)
        other = (engine + rng.randrange(1, ENGINES)) % ENGINES
        faults.append(Fault(at, kind, engine, rng.randrange(1, 5), rng.uniform(0.02, 0.15), other))
    faults.append(Fault(rng.uniform(0.2, duration_s * 0.6), "restart", rng.randrange(ENGINES)))
    return sorted(faults, key=lambda fault: fault.at_s)


def well_formed_sse(raw: bytes, *, chat: bool) -> str | None:
    """None if ``raw`` is a whole OpenAI SSE stream ending in ``data: [DONE]``; else what is wrong."""
    text = raw.decode()
    if not text.endswith("data: [DONE]\n\n"):
        return f"does not end in [DONE]: {text[-80:]!r}"
    events = text[: -len("\n\n")].split("\n\n")
    for event in events[:-1]:
        if not event.startswith("data: ") or "\n" in event:
            return f"not one data line: {event[:80]!r}"
        chunk = json.loads(event[len("data: ") :])
        if chunk.get("object") != ("chat.completion.chunk" if chat else "text_completion"):
            return f"not a chunk: {event[:80]!r}"
    return None


async def client(session: aiohttp.ClientSession, url: str, spec: Spec, tally: Tally) -> None:
    if spec.leave in ("read", "chunks"):
        await reader_client(session, url, spec, tally)
    else:
        await raw_client(url, spec, tally)


async def reader_client(session: aiohttp.ClientSession, url: str, spec: Spec, tally: Tally) -> None:
    headers = {"Content-Type": "application/json", **spec.headers}
    sent_at = time.monotonic() - tally.started
    try:
        async with session.post(url + spec.path, data=spec.body, headers=headers) as response:
            tally.statuses[str(response.status)] += 1
            if spec.hostile:
                assert response.status == 400, (response.status, spec.body[:60])
                return
            if spec.leave == "chunks":
                for _ in range(spec.chunks):
                    if not await response.content.readany():
                        break
                response.close()  # leaves: the connection goes
                return
            raw = await response.read()
    except aiohttp.ClientPayloadError:  # a backend broke off mid-answer: the client sees it incomplete
        tally.statuses["broken"] += 1
        return
    except asyncio.TimeoutError:  # a request lost on the way: the test fails, with the run's report
        tally.timed_out.append(f"{spec.path} stream={spec.stream} sent at {sent_at:.2f} s")
        return
    if response.status == 200:
        tally.whole_ok += 1
        if response.content_type == "text/event-stream":
            tally.whole_streams += 1
            problem = well_formed_sse(raw, chat="chat" in spec.path)
            if problem:
                tally.bad_sse.append(problem)


async def raw_client(url: str, spec: Spec, tally: Tally) -> None:
    """Send the request over a socket of its own and leave as ``spec.leave`` says. ``Expect: 100-continue`` makes
    the proxy's handler start before the body goes, so every request counted as sent is one the proxy saw."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (
            f"POST {spec.path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(spec.body)}\r\nExpect: 100-continue\r\n\r\n"
        )
        writer.write(head.encode())
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim.startswith(b"HTTP/1.1 100"), interim
        if spec.leave == "mid-body":
            writer.write(spec.body[: len(spec.body) // 2])
            await writer.drain()
            return
        writer.write(spec.body)
        await writer.drain()
        if spec.leave in ("timeout", "never-read"):
            if spec.leave == "timeout":

                async def read_all() -> None:
                    while await reader.read(65536):
                        pass

                with contextlib.suppress(asyncio.TimeoutError):  # reads what comes until its deadline, then gives up
                    await asyncio.wait_for(read_all(), spec.wait_s)
            else:
                await asyncio.sleep(spec.wait_s)
    finally:
        tally.statuses[spec.leave] += 1
        if spec.abort:
            writer.transport.abort()
        else:
            writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def chaos(engines: list[OpenAIEngine], faults: list[Fault], started: float, log: list[str]) -> None:
    """Apply the faults at their times (each hold ends before the next fault; stalls resume before a restart)."""
    for fault in faults:
        await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - started)))
        engine = engines[fault.engine]
        log.append(f"{time.monotonic() - started:.3f} {fault.kind} {fault.engine}")
        if fault.kind == "fail":
            engine.fail_next(fault.count, status=500 if fault.count % 2 else 503)
        elif fault.kind in ("refuse", "refuse-two", "fail-after-refuse"):
            await asyncio.to_thread(engine.refuse)
            other = engines[fault.other]
            if fault.kind == "refuse-two":
                await asyncio.to_thread(other.refuse)
            elif fault.kind == "fail-after-refuse":
                other.fail_next(fault.count)
            await asyncio.sleep(fault.hold_s)
            await asyncio.to_thread(engine.accept)
            if fault.kind == "refuse-two":
                await asyncio.to_thread(other.accept)
        elif fault.kind == "stall":
            engine.stall(after_tokens=fault.count % TOKENS)
            await asyncio.sleep(fault.hold_s)
            engine.resume()
        elif fault.kind == "restart":
            port = int(engine.url.rsplit(":", 1)[1])
            await asyncio.to_thread(engine.stop)
            await asyncio.sleep(0.05)
            engines[fault.engine] = await asyncio.to_thread(
                OpenAIEngine(seed=fault.engine, max_tokens=TOKENS, token_delay_s=TOKEN_DELAY_S, port=port).start
            )


async def drive(proxy: Proxy, engines: list[OpenAIEngine], seed: int) -> tuple[Tally, list[str]]:
    rng = random.Random(seed)
    specs = plan_requests(rng)
    faults = plan_faults(rng, duration_s=2.0)
    in_flight = asyncio.Semaphore(rng.randrange(20, 51))
    started = time.monotonic()
    tally = Tally(started, sent=len(specs), hostile=sum(spec.hostile for spec in specs))
    log: list[str] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(spec: Spec) -> None:
            async with in_flight:
                await client(session, proxy.url, spec, tally)

        fault_task = asyncio.create_task(chaos(engines, faults, started, log))
        await asyncio.gather(*(one(spec) for spec in specs))
        await fault_task
    for engine in engines:
        engine.resume()
        await asyncio.to_thread(engine.accept)
        engine.fail_next(0)
    return tally, log


async def settled(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


@pytest.mark.parametrize(
    ("seed", "policy"),
    [(11, BoundedLoad), (22, BoundedLoad), (33, BoundedLoad), (44, SlowBoundedLoad)],
    ids=["seed11", "seed22", "seed33", "seed44-slow-policy"],
)
def test_the_books_balance_after_seeded_chaos(seed: int, policy: type[BoundedLoad]) -> None:
    engines = [OpenAIEngine(seed=i, max_tokens=TOKENS, token_delay_s=TOKEN_DELAY_S).start() for i in range(ENGINES)]
    try:
        with Proxy(Router(policy=policy()), [engine.url for engine in engines], cooldown=0.3) as proxy:
            tally, log = asyncio.run(drive(proxy, engines, seed))
            router = proxy.router

            def outcomes() -> int:
                s = proxy.stats()
                return s.ok + s.backend_error + s.unreachable + s.client_disconnect + s.bad_request + s.internal_error

            asyncio.run(settled(lambda: router.stats().in_flight == 0 and outcomes() == tally.sent))
            asyncio.run(settled(lambda: sum(engine.stats().running for engine in engines) == 0))
            candidates = router.decide([7] * 64, proxy.backends).candidates
            books = {c.backend: (c.in_flight, c.pending_prefill_tokens, c.held_blocks) for c in candidates}
            stats, rstats = proxy.stats(), router.stats()
            report = (
                f"seed={seed} policy={policy.__name__} sent={tally.sent} hostile={tally.hostile} "
                f"clients={dict(tally.statuses)} whole_ok={tally.whole_ok} streams={tally.whole_streams} "
                f"proxy={stats} router={rstats} books={books} "
                f"engines={[engine.stats() for engine in engines]} faults={log}"
            )
            print(report)  # shown with -s, and on failure
            assert not tally.timed_out, (tally.timed_out, report)
            assert rstats.in_flight == 0, report
            assert set(books.values()) == {(0, 0, 0)}, report
            assert outcomes() == tally.sent, report
            assert stats.bad_request == tally.hostile, report
            assert stats.internal_error == 0, report
            assert stats.ok >= tally.whole_ok, report
            assert rstats.ignored == 0, report
            assert not tally.bad_sse, (tally.bad_sse[:3], report)
            assert sum(engine.stats().running for engine in engines) == 0, report
            metrics = [line for line in proxy.metrics_text().splitlines() if line.startswith("prefixroute_router_in")]
            assert metrics and all(line.endswith(" 0") for line in metrics), (metrics, report)
            router._check()
    finally:
        for engine in engines:
            engine.stop()
