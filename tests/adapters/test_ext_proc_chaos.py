"""The Envoy ext_proc endpoint picker under seeded chaos: a few hundred concurrent ``Process`` streams a seed, from a
real gRPC client to ``prefixroute serve --ext-proc``'s own server (:func:`start_ext_proc`), send what Envoy sends: the
request headers, then a body of token ids, text or chat (in one message, in chunks of a streamed body, or one buffered
message ended by trailers), then the response phases (a 200, an upstream error, a refusal, or none, as a mode that skips
them sends). Clients cancel at every phase (after the headers, after the body before its answer, after the routing
answer, before the response headers, the body or the trailers), some hold their stream open without a response (only the
lease ends those; some send it after the lease ran out, or lose their connection first), and hostile ones send empty or
corrupt messages, phases out of order, bodies over the limit, bad JSON, a body sent twice, trailers before a body, or
headers that end the request. Meanwhile the backends' health (down to none: fail open), capacity and engine load change,
KV events store, evict and clear blocks, the router's fake clock steps (short of any lease), and the router's invariants
are checked.

At the end the books must balance exactly, whatever the interleaving: every answer fits the message it answers (one
answer a message, of its phase; a routing answer names a fixed backend in its header and in ``envoy.lb`` and replaces
the client's own headers), each decision is made once and finished once (by its response's end or its stream's end,
however it ended), first tokens come from 200 answers only, refusals are counted under their status alone, the held
streams' decisions are in flight until the lease and run out then, after which nothing is in flight, pending prefill,
held or active on any backend, ``/stats`` and ``/metrics`` agree (and ``/metrics`` parses), and ``Router._check()``
holds. The one thing the client cannot know is whether a body whose answer it did not wait for was routed before its
cancel arrived: the books bound those, and the finishes follow the decisions whatever they were.

The server and its clients share one event loop, uvloop's as ``prefixroute serve`` runs it (the sidecar is not
thread-safe, so the invariants are checked there); the plan, the faults and their times are drawn from one seeded
``random.Random`` before the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from prefixroute import BlockHash, Router, policy_from_name
from prefixroute.adapters.serve import PromptEncoder, Sidecar, upstream_of
from prefixroute.adapters.serve.ext_proc import DESTINATION_HEADER, start_ext_proc

from ..conftest import FakeClock
from .conftest import CORPUS
from .test_serve_chaos import Fault, Health, apply_fault, plan_faults
from .test_serve_contract_blackbox import parse_exposition

FIXED = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]  # the picker only decides: nothing listens there
UPSTREAMS = {upstream_of(backend) for backend in FIXED}
BLOCK = 4
LEASE_S = 60.0
STEP_S = 1.0
MAX_BODY = 128 * 2**10
STREAMS = 240
RUN_S = 1.0  # streams start over this long
# The fleet's changes while the picker serves (plan_faults() moves the clock at most 8 s: no lease runs out).
PICKER_FAULTS = ("step", "health", "capacity", "load", "store", "store", "evict", "clear", "check", "check")
CHANNELS = 4  # Envoy's connections to the picker (and one more, which is lost with the streams it holds)
TIMEOUT_S = 20.0
METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
WORDS = sorted({word for line in CORPUS for word in line.replace(";", " ").split()})
SYSTEMS = [" ".join(random.Random(s).choices(WORDS, k=30)) for s in range(4)]  # shared prefixes
SEEDS = [(11, "predicted-ttft"), (22, "bounded-load"), (33, "cost-aware")]
STATUSES = ["200"] * 6 + ["", "", "400", "429", "500", "503"]  # "": the response headers are not sent (SKIP)
BODY_MODES = [None, ProcessingMode.BUFFERED, ProcessingMode.STREAMED]


# -- the messages -----------------------------------------------------------------------------------------------------


def header_map(**fields: str) -> Any:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in fields.items()])


def request_headers(path: str, *, end: bool = False, body_mode: int | None = None) -> Any:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=header_map(**{":path": path, DESTINATION_HEADER: "evil:1"}), end_of_stream=end
        )
    )
    if body_mode is not None:
        message.protocol_config.request_body_mode = body_mode
    return message


def request_body(data: bytes, *, end: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def request_trailers() -> Any:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=header_map(**{"x-checksum": "0"})))


def response_headers(status: str) -> Any:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(**{":status": status})))


def response_body(*, end: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n", end_of_stream=end))


def response_trailers() -> Any:
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers(trailers=header_map(**{"grpc-status": "0"})))


def serialize(message: Any) -> bytes:
    """A message as sent; raw bytes (an empty or a corrupt message) as they are."""
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


# -- the plan ---------------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One message of a stream and what its answer must be."""

    message: Any  # a ProcessingRequest, or raw bytes
    expect: str  # the answer's phase; "route": a request_body answer with a destination; "abort": INVALID_ARGUMENT
    pause_s: float = 0.0  # before it is sent
    first_token: bool = False  # its answer means a first token was reported
    refused: int = 0  # the status its answer means was counted as refused (0: none)


@dataclass
class Stream:
    at_s: float
    kind: str  # "good" or "hostile"
    steps: list[Step]
    end: str  # "close" (half-close, read to the end), "cancel" (after the last step), "hold" (until the lease ran
    # out), "drop" (held until its connection is lost: the client closes it, as an Envoy that restarts)
    read_last: bool = True  # whether the answer to the last step is read before the end
    late: list[Step] = field(default_factory=list)  # a held stream's response, once its lease ran out (then closed)
    channel: int = 0


def phase_of(message: Any) -> str:
    return str(message.WhichOneof("request"))


def plain(message: Any, **kwargs: Any) -> Step:
    return Step(message, phase_of(message), **kwargs)


def good_body(rng: random.Random, max_id: int) -> tuple[str, bytes]:
    """A completion or chat completion body: token ids, text or chat, sharing one of a few system prompts; a few are
    long enough to be tokenized on a worker thread."""
    system = rng.randrange(len(SYSTEMS))
    question = " ".join(rng.choices(WORDS, k=rng.randrange(1, 12)))
    fields: dict[str, Any] = {"model": "fake-model", "max_tokens": 16, "stream": rng.random() < 0.5}
    form = rng.choice(["ids", "ids", "text", "chat", "chat"] if rng.random() > 0.02 else ["long"])
    if form == "chat":
        fields["messages"] = [{"role": "system", "content": SYSTEMS[system]}, {"role": "user", "content": question}]
        return "/v1/chat/completions", json.dumps(fields).encode()
    if form == "ids":
        seeded = random.Random(system)
        fields["prompt"] = [seeded.randrange(max_id + 1) for _ in range(24)] + [
            rng.randrange(max_id + 1) for _ in range(rng.randrange(1, 30))
        ]
    elif form == "text":
        fields["prompt"] = f"{SYSTEMS[system]} {question}"
    else:  # over 64 KiB: tokenized off the event loop, where a cancel may come meanwhile
        fields["prompt"] = f"{SYSTEMS[system]} " + " ".join(rng.choices(WORDS, k=rng.randrange(12_000, 16_000)))
    return "/v1/completions", json.dumps(fields).encode()


def body_steps(rng: random.Random, data: bytes, mode: int | None, pause: float) -> list[Step]:
    """The body as Envoy sends it: one message, chunks of a streamed body, or one buffered message the trailers end
    (routed on the body's answer only when Envoy said BUFFERED; an older Envoy's is not routed)."""
    delivery = rng.choice(["one", "one", "chunks", "trailers"])
    if delivery == "chunks" and mode == ProcessingMode.BUFFERED:  # Envoy buffers the body whole: one message
        delivery = "one"
    if delivery == "one":
        return [Step(request_body(data, end=True), "route", pause)]
    if delivery == "chunks":
        count = rng.randrange(2, 5)
        size = -(-len(data) // count)
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        steps = [Step(request_body(piece, end=False), "request_body", pause) for piece in pieces[:-1]]
        return [*steps, Step(request_body(pieces[-1], end=True), "route", pause)]
    routed = mode == ProcessingMode.BUFFERED
    return [Step(request_body(data, end=False), "route" if routed else "request_body", pause),
            Step(request_trailers(), "request_trailers", pause)]  # fmt: skip


def response_steps(rng: random.Random, pause: float) -> list[Step]:
    status = rng.choice(STATUSES)
    steps = [] if status == "" else [plain(response_headers(status), pause_s=pause)]
    chunks = rng.randrange(1, 4)
    for i in range(chunks):
        end = i == chunks - 1 and rng.random() < 0.9  # or the stream ends before the body does
        steps.append(plain(response_body(end=end), pause_s=pause, first_token=i == 0 and status in ("", "200")))
    if rng.random() < 0.3:
        steps.append(plain(response_trailers(), pause_s=pause))
    return steps


def plan_good(rng: random.Random, at: float, max_id: int) -> Stream:
    path, data = good_body(rng, max_id)
    mode = rng.choice(BODY_MODES)
    pause = rng.choice([0.0, 0.0, 0.002])
    steps = [plain(request_headers(path, body_mode=mode), pause_s=pause), *body_steps(rng, data, mode, pause)]
    routed_at = next((i for i, step in enumerate(steps) if step.expect == "route"), None)
    if routed_at is None:  # an older Envoy's body ended by trailers: falls back to Envoy's pool, unrouted
        return Stream(at, "good", [*steps, *response_steps(rng, pause)], "close")
    roll = rng.random()
    if roll < 0.15:  # held open without a response: only the lease ends it (a response may come after it)
        if rng.random() < 0.25:  # or the loss of its connection
            return Stream(at, "good", steps[: routed_at + 1], "drop", channel=CHANNELS)
        late = response_steps(rng, pause) if rng.random() < 0.5 else []
        return Stream(at, "good", steps[: routed_at + 1], "hold", late=late)
    steps += response_steps(rng, pause)
    if roll < 0.5:  # cancelled after any step: after the headers, the body (answer read or not), any response phase
        cut = rng.randrange(len(steps))
        read = cut != routed_at or rng.random() < 0.5
        return Stream(at, "good", steps[: cut + 1], "cancel", read_last=read)
    if roll < 0.6:  # Envoy closes the stream right after the routing answer (the upstream failed, say)
        return Stream(at, "good", steps[: routed_at + 1], "close")
    return Stream(at, "good", steps, "close")


def plan_hostile(rng: random.Random, at: float, max_id: int) -> Stream:
    path, data = good_body(rng, max_id)
    pick = request_headers("/v1/completions")
    kind = rng.choice(["empty-first", "corrupt", "empty-later", "order", "body-first", "huge", "huge-chunks",
                       "bad-json", "twice", "trailers-first", "headers-end", "not-openai"])  # fmt: skip
    steps: list[Step]
    if kind == "empty-first":
        steps = [Step(b"", "abort", refused=400)]
    elif kind in ("corrupt", "empty-later"):  # after a decision: it is released when the stream is aborted
        bad = rng.choice([b"\x08\x01garbage\xff", b"\xff" * 40, b"\x1a\x05ab"]) if kind == "corrupt" else b""
        steps = [plain(request_headers(path)), Step(request_body(data, end=True), "route"),
                 Step(bad, "abort", refused=400)]  # fmt: skip
    elif kind == "order":  # the response before the request: each answered in its phase, the body still routed
        steps = [plain(response_headers("200")), plain(response_body(end=True)), plain(response_trailers()),
                 plain(request_headers(path)), Step(request_body(data, end=True), "route")]  # fmt: skip
    elif kind == "body-first":  # no request headers: no path, so not the picker's to route or count
        steps = [plain(request_body(data, end=True)), plain(request_headers(path))]
    elif kind == "huge":
        huge = json.dumps({"prompt": [1, 2, 3], "pad": "x" * MAX_BODY}).encode()
        steps = [plain(pick), Step(request_body(huge, end=True), "request_body", refused=413)]
    elif kind == "huge-chunks":
        chunk = json.dumps({"prompt": [1, 2, 3], "pad": "x" * (MAX_BODY // 3)}).encode()
        steps = [plain(pick), *(plain(request_body(chunk, end=False)) for _ in range(3)),
                 plain(request_body(chunk, end=True))]  # fmt: skip
        steps[3].refused = 413  # the third chunk takes it over the limit
    elif kind == "bad-json":
        bad = rng.choice([b"{", b"null", b'{"prompt": ""}', b'{"prompt": [1, -2]}', b'{"messages": "hi"}',
                          b'{"prompt": [100000]}', b"\xff\xfe"])  # fmt: skip
        steps = [plain(pick), Step(request_body(bad, end=True), "request_body", refused=400)]
    elif kind == "twice":  # a body sent again after its end is no second request
        steps = [plain(request_headers(path)), Step(request_body(data, end=True), "route"),
                 plain(request_body(data, end=True))]  # fmt: skip
    elif kind == "trailers-first":  # an empty body ended by trailers: HTTP's empty body, a 400
        steps = [plain(pick), Step(request_trailers(), "request_trailers", refused=400),
                 plain(request_body(data, end=True))]  # fmt: skip
    elif kind == "headers-end":
        steps = [Step(request_headers(path, end=True), "request_headers", refused=400)]
    else:
        steps = [plain(request_headers("/healthz")), plain(request_body(data, end=True))]
    if steps[-1].expect != "abort" and rng.random() < 0.7:
        steps += response_steps(rng, 0.0)
    return Stream(at, "hostile", steps, "close" if rng.random() < 0.8 else "cancel")


def plan_streams(rng: random.Random, max_id: int) -> list[Stream]:
    streams = []
    for _ in range(STREAMS):
        at = rng.uniform(0.0, RUN_S)
        stream = plan_hostile(rng, at, max_id) if rng.random() < 0.2 else plan_good(rng, at, max_id)
        if stream.end != "drop":
            stream.channel = rng.randrange(CHANNELS)
        streams.append(stream)
    return streams


# -- the run ----------------------------------------------------------------------------------------------------------


@dataclass
class Books:
    """What the clients know, from which the picker's counters follow."""

    routed: set[str] = field(default_factory=set)  # decision ids read in routing answers
    maybe_routed: int = 0  # bodies to route whose stream was cancelled before their answer was read
    held: int = 0  # routed streams held open until the lease ran out
    dropped: int = 0  # routed streams held open until their connection was lost
    first_tokens: int = 0
    late_first_tokens: int = 0  # of those, ones that came after their lease ran out (counted unknown)
    refused: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


class Client:
    def __init__(self, channels: list[grpc.aio.Channel], books: Books, started: float) -> None:
        self.calls = [
            channel.stream_stream(
                METHOD, request_serializer=serialize, response_deserializer=pb.ProcessingResponse.FromString
            )
            for channel in channels
        ]
        self.books = books
        self.started = started
        self.lease_over = asyncio.Event()  # the held streams end once every lease ran out
        self.connection_lost = asyncio.Event()  # the dropped streams' connection is closed

    async def run(self, number: int, stream: Stream) -> None:
        await asyncio.sleep(max(0.0, stream.at_s - (time.monotonic() - self.started)))
        call = self.calls[stream.channel](timeout=TIMEOUT_S)
        try:
            await self.steps(call, stream)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with the run's books
            steps = [step.expect for step in stream.steps]
            self.books.problems.append(f"stream {number} {stream.kind} {steps} end={stream.end}: {exc!r}")
        finally:
            call.cancel()  # a no-op once the call is over

    async def steps(self, call: Any, stream: Stream) -> None:
        books = self.books
        routed = False
        for i, step in enumerate(stream.steps):
            await asyncio.sleep(step.pause_s)
            await call.write(step.message)
            if step.expect == "abort":
                try:
                    answer = await call.read()
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
                else:
                    assert answer is grpc.aio.EOF, answer
                    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
                books.refused[step.refused] += 1
                return
            last = i == len(stream.steps) - 1
            if last and not stream.read_last:  # cancelled before its answer: routed, or not
                books.maybe_routed += step.expect == "route"
                return
            answer = await call.read()
            check_answer(step, answer)
            if step.expect == "route":
                decision_id = decision_of(answer)
                assert decision_id not in books.routed, f"decision {decision_id} given twice"
                books.routed.add(decision_id)
                routed = True
            books.first_tokens += step.first_token and routed
            if step.refused:
                books.refused[step.refused] += 1
        if stream.end == "drop":
            books.dropped += 1
            await self.connection_lost.wait()
        elif stream.end == "hold":
            books.held += 1
            await self.lease_over.wait()
            for step in stream.late:
                await call.write(step.message)
                check_answer(step, await call.read())
                books.first_tokens += step.first_token
                books.late_first_tokens += step.first_token
            if stream.late:  # the finish comes at the body's end, or at the stream's: either finds nothing
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
        elif stream.end == "close":
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK


def check_answer(step: Step, answer: Any) -> None:
    """One answer, of the phase of the message it answers; only a routing answer changes anything, and it sets the
    destination (replacing a client's own header) and the ``envoy.lb`` metadata alike."""
    assert answer is not grpc.aio.EOF, f"the stream ended before the answer to {step.expect}"
    phase = "request_body" if step.expect == "route" else step.expect
    assert answer.WhichOneof("response") == phase, (step.expect, answer)
    if step.expect != "route":  # an empty answer of its phase: nothing changed, nothing else said
        assert not getattr(answer, phase).ListFields() and not answer.HasField("dynamic_metadata"), answer
        return
    common = answer.request_body.response
    headers = {h.header.key: h for h in common.header_mutation.set_headers}
    assert set(headers) == {DESTINATION_HEADER, "x-prefixroute-id"}, answer
    assert all(h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD for h in headers.values())
    destination = headers[DESTINATION_HEADER].header.raw_value.decode()
    assert destination in UPSTREAMS, destination
    assert answer.dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == destination, answer
    assert common.clear_route_cache, answer


def decision_of(answer: Any) -> str:
    mutation = answer.request_body.response.header_mutation
    return str(next(h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == "x-prefixroute-id"))


async def chaos(faults: list[Fault], router: Router, clock: FakeClock, health: Health, chains: list[list[BlockHash]],
                started: float) -> None:  # fmt: skip
    """The fleet's changes at their times, on the picker's loop."""
    for fault in faults:
        await asyncio.sleep(max(0.0, fault.at_s - (time.monotonic() - started)))
        apply_fault(fault, router, clock, health, chains)


async def settle(sidecar: Sidecar, finishes: int, what: str) -> None:
    """Wait (on the loop the picker runs on) until the picker has reported ``finishes`` finishes and first tokens."""
    deadline = time.monotonic() + TIMEOUT_S
    while sidecar.metrics.releases.get("ext_proc", 0) < finishes and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # and nothing more comes
    assert sidecar.metrics.releases.get("ext_proc", 0) == finishes, (what, sidecar.stats())


async def read(sidecar: Sidecar, path: str) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sidecar), base_url="http://sidecar") as client:
        answer = await client.get(path)
    assert answer.status_code == 200, answer
    return answer.text


async def drive(sidecar: Sidecar, streams: list[Stream], faults: list[Fault], clock: FakeClock, health: Health,
                chains: list[list[BlockHash]]) -> str:  # fmt: skip
    """Run the streams and the faults; then, held streams aside, every decision must be finished; then the lease
    runs out, the held streams end, and the books must balance. Returns the run's report."""
    router = sidecar.router
    server, port = await start_ext_proc(sidecar, "127.0.0.1", 0)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS + 1)]  # fmt: skip
    books = Books()
    started = time.monotonic()
    client = Client(channels, books, started)
    try:
        held_ends = ("hold", "drop")
        runs = [asyncio.ensure_future(client.run(i, s)) for i, s in enumerate(streams) if s.end not in held_ends]
        held = [asyncio.ensure_future(client.run(i, s)) for i, s in enumerate(streams) if s.end in held_ends]
        await asyncio.gather(chaos(faults, router, clock, health, chains, started), *runs)
        while books.held + books.dropped + len(books.problems) < len(held) and time.monotonic() - started < TIMEOUT_S:
            await asyncio.sleep(0.005)
        await channels[CHANNELS].close()  # the connection is lost, and with it the streams it held
        client.connection_lost.set()
        decisions = router.stats().decisions
        report = f"books={books} stats={sidecar.stats()} router={router.stats()}"
        assert not books.problems, (books.problems[:5], report)
        # Every decision but the held streams' is finished, once: by its response's end or its stream's.
        await settle(sidecar, decisions - books.held + books.first_tokens, "the finishes of the ended streams")
        assert router.stats().in_flight == books.held, report
        before = router.stats()
        clock.tick(10 * LEASE_S)  # every lease runs out: the held streams' decisions end so
        after = router.stats()
        assert (after.in_flight, after.leases_expired - before.leases_expired) == (0, books.held), report
        client.lease_over.set()
        await asyncio.gather(*held)
        await settle(sidecar, decisions + books.first_tokens, "the finishes of the held streams")
        router._check()
        stats, metrics = json.loads(await read(sidecar, "/stats")), await read(sidecar, "/metrics")
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(None)
    final = router.stats()
    report = f"books={books} stats={stats} router={final}"
    assert not books.problems, (books.problems[:5], report)
    routed = len(books.routed)
    assert routed <= final.decisions <= routed + books.maybe_routed, report
    assert final.commits == final.decisions == sum(stats["decisions"].values()), report
    # Each decision ended once: the held ones by their lease (their stream's late first token and finish then found
    # nothing), the rest by their stream; a first token or finish that found no request would be counted here too.
    assert (final.leases_expired, final.ignored) == (books.held, books.held + books.late_first_tokens), report
    assert stats["releases"] == {"ext_proc": final.decisions + books.first_tokens}, report
    assert stats["bad_requests"] == {str(status): n for status, n in books.refused.items()}, report
    assert stats["in_flight_total"] == final.in_flight == 0 and set(stats["in_flight"].values()) == {0}, report
    candidates = router.decide([1] * 8, FIXED).candidates
    by_backend = {c.backend: (c.in_flight, c.pending_prefill_tokens, c.held_blocks, c.active_blocks, c.in_prefill)
                  for c in candidates}  # fmt: skip
    assert set(by_backend.values()) == {(0, 0, 0, 0, 0)}, (by_backend, report)
    samples = parse_exposition(metrics)
    families = {family.name for family in text_string_to_metric_families(metrics)}
    assert {"prefixroute_decisions", "prefixroute_in_flight"} <= families, report
    in_flight = {labels: v for (name, labels), v in samples.items() if name == "prefixroute_in_flight"}
    assert len(in_flight) == len(FIXED) and set(in_flight.values()) == {0.0}, (in_flight, report)
    decided = sum(v for (name, _), v in samples.items() if name == "prefixroute_decisions_total")
    assert decided == final.decisions, report
    assert samples[("prefixroute_unknown_finishes_total", ())] == final.ignored, report
    return report


@pytest.mark.parametrize(("seed", "policy"), SEEDS, ids=[f"seed{s}-{p}" for s, p in SEEDS])
def test_the_books_balance_after_seeded_chaos_on_the_ext_proc_streams(seed: int, policy: str, model_dir: Path) -> None:
    encoder = PromptEncoder(model_dir)
    rng = random.Random(seed)
    streams = plan_streams(rng, encoder.max_token_id)
    faults = plan_faults(rng, kinds=PICKER_FAULTS, backends=FIXED, run_s=RUN_S)
    clock, health = FakeClock(1000.0), Health()
    router = Router(block_size=BLOCK, policy=policy_from_name(policy), clock=clock, rng=random.Random(seed))
    sidecar = Sidecar(router, backends=FIXED, encoder=encoder, lease=LEASE_S, max_body_bytes=MAX_BODY, healthy=health,
                      base_models=frozenset({"fake-model"}))  # fmt: skip
    chains = [router.hasher.hash(encoder.encode(system)) for system in SYSTEMS]
    report = uvloop.run(drive(sidecar, streams, faults, clock, health, chains))  # as prefixroute serve runs it
    print(report)  # shown with -s
