"""The latency ``prefixroute proxy`` adds to a streamed completion, and its streamed requests/s on one core.

Method. Four fake vLLM engines (``prefixroute fake-engines``: one process, no prefill time, ``--answer-tokens``
tokens each ``--token-delay-ms`` apart, so every token is its own SSE chunk as from a real engine) and
``prefixroute proxy`` in front of them (with a word-level ``tokenizer.json`` built here) run as separate processes
on loopback; this process is the load. The proxy is pinned to CPU 0, the engines and the load to the other CPUs.
Prompts are 2K tokens: one of 8 shared 1K-token system prompts plus a unique 1K-token suffix, sent as token ids
(``ids``), as text that the proxy tokenizes (``text``: its piece cache cuts long text between words, so the shared
half is encoded once), or as chat messages, the shared half the system message and the unique half the user's
(``chat``: the tokenizer has the chat markers as special tokens, as a chat model's has, so the proxy's piece cache
encodes only the user's message). The load speaks raw HTTP/1.1 on keep-alive connections,
so its own cost is small and the same both ways.

* **Added latency**: sequential streamed requests, each prompt sent once straight to an engine and once through
  the proxy, alternately (so drift hits both alike). TTFT is the first body byte (vLLM sends its headers before
  prefill, the proxy after the engine's), total the end of the stream. P50 and P99 of each way; *added* is the
  proxied figure minus the direct one.
* **Requests/s per core**: a closed loop of ``--concurrency`` connections through the proxy; the proxy's CPU time
  (user + system, from /proc) per request, as requests per CPU-second, which is what one core sustains whether or
  not the engines let the proxy saturate it. The wall rate is printed beside it.

Each figure is the median of ``--runs`` runs after a warm-up. Targets (issue 11): added P50 <= 1 ms, >= 1,000
streamed requests/s per core.

Run: ``python benchmarks/bench_proxy.py`` (``--quick`` for a smoke run; ``--profile`` writes a py-spy profile of
the proxy under the closed loop, when py-spy is installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from _args import Parser, check_output, non_negative_float, positive_int

from prefixroute.adapters.serve.loopback import Process, free_port

ENGINES = 4
Runner = Callable[[Any], Any]
"""Runs a coroutine to its end on a fresh event loop and returns its result."""
VOCABULARY = 4000


def build_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer.json: ``word(i)`` is token ``i + 1`` (so text and ids name the same tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {word(i): i + 1 for i in range(VOCABULARY)}
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **words}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|system|>", "<|user|>", "<|assistant|>"])  # the markers of serialise_chat
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def prompts(count: int, *, tokens: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` ids: one of 8 shared half-length prefixes, then a unique half."""
    rng = random.Random(seed)
    half = tokens // 2
    systems = [[rng.randrange(1, VOCABULARY) for _ in range(half)] for _ in range(8)]
    return [systems[i % 8] + [rng.randrange(1, VOCABULARY) for _ in range(tokens - half)] for i in range(count)]


KINDS = ("ids", "text", "chat")


def words(tokens: list[int]) -> str:
    return " ".join(word(t - 1) for t in tokens)


def word(i: int) -> str:
    """``w`` then ``i`` in base 26 written with the letters a to z: words of letters, as in text."""
    letters = ""
    while True:
        i, digit = divmod(i, 26)
        letters = chr(ord("a") + digit) + letters
        if not i:
            return "w" + letters


def request_bytes(prompt: list[int], *, kind: str, answer_tokens: int) -> bytes:
    """One streamed ``/v1/completions`` (or, for ``chat``, ``/v1/chat/completions``) HTTP/1.1 request, keep-alive."""
    body: dict[str, Any] = {"model": "fake-model", "stream": True, "max_tokens": answer_tokens}
    if kind == "chat":
        half = len(prompt) // 2
        body["messages"] = [{"role": "system", "content": words(prompt[:half])},
                            {"role": "user", "content": words(prompt[half:])}]  # fmt: skip
    else:
        body["prompt"] = words(prompt) if kind == "text" else prompt
    payload = json.dumps(body, separators=(",", ":")).encode()
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    return head.encode() + payload


class Connection:
    """A keep-alive HTTP/1.1 connection that sends a prepared streamed request and times its answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def ask(self, request: bytes) -> tuple[float, float]:
        """Send ``request``; return (seconds to the first body byte, seconds to the end of the chunked stream)."""
        begin = time.perf_counter()
        self.writer.write(request)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += await self._read()
        head, _, body = buffer.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"answer {head.splitlines()[0]!r}: {body[:300]!r}")
        while not body:
            body = await self._read()
        first = time.perf_counter()
        tail = body[-5:]
        while not tail.endswith(b"0\r\n\r\n"):  # the chunked encoding's last chunk
            tail = (tail + await self._read())[-5:]
        return first - begin, time.perf_counter() - begin

    async def _read(self) -> bytes:
        data = await self.reader.read(1 << 16)
        if not data:
            raise RuntimeError("the server closed the connection")
        return data

    def close(self) -> None:
        self.writer.close()


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def latency_run(ports: dict[str, list[int]], requests: list[bytes]) -> dict[str, tuple[list[float], list[float]]]:
    """Each request to every way in turn (``ports[way]``: round robin over them); the (TTFT, total) s of each."""
    connections: dict[str, list[Connection]] = {}
    for way, each in ports.items():  # a loop: Python 3.10 refuses an await in a comprehension nested in another
        connections[way] = [await Connection.open(port) for port in each]
    times: dict[str, tuple[list[float], list[float]]] = {way: ([], []) for way in ports}
    try:
        for i, request in enumerate(requests):
            for way, opened in connections.items():
                ttft, total = await opened[i % len(opened)].ask(request)
                times[way][0].append(ttft)
                times[way][1].append(total)
    finally:
        for opened in connections.values():
            for connection in opened:
                connection.close()
    return times


async def closed_loop(port: int, requests: list[bytes], *, concurrency: int) -> int:
    """``concurrency`` connections each sending the next request as soon as its last answer ended; return count."""
    queue = iter(requests)

    async def client() -> int:
        connection = await Connection.open(port)
        done = 0
        try:
            for request in queue:
                await connection.ask(request)
                done += 1
        finally:
            connection.close()
        return done

    return sum(await asyncio.gather(*(client() for _ in range(concurrency))))


def pin(pid: int, cpus: set[int]) -> None:
    if hasattr(os, "sched_setaffinity") and cpus:
        os.sched_setaffinity(pid, cpus)


def consecutive_free_ports(count: int) -> int:
    """A port p such that p .. p + count - 1 are free on 127.0.0.1 now."""
    while True:
        base = free_port()
        if base + count >= 65536:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


def wait_healthy(process: Process, url: str, *, timeout: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.output()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} did not answer {url} in {timeout} s:\n{process.output()}")
        time.sleep(0.05)


def spawn(command: list[str], name: str, folder: Path) -> Process:
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Process(popen, name, log)


def main(argv: Sequence[str] | None = None) -> None:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=positive_int, default=5, help="runs per figure, after a warm-up (5)")
    parser.add_argument("--requests", type=positive_int, default=150, help="sequential requests per latency run (150)")
    parser.add_argument("--loop-requests", type=positive_int, default=1000, help="requests per closed-loop run (1000)")
    parser.add_argument("--concurrency", type=positive_int, default=32, help="closed-loop connections (32)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=2048, help="tokens per prompt (2048)")
    parser.add_argument("--answer-tokens", type=at_most(positive_int, MAX_ANSWER_TOKENS), default=16,
                        help=f"streamed tokens per answer (16; at most {MAX_ANSWER_TOKENS:,})")  # fmt: skip
    parser.add_argument("--token-delay-ms", type=at_most(non_negative_float, MAX_TOKEN_DELAY_MS), default=1.0,
                        help=f"engine time between tokens (1 ms; at most {MAX_TOKEN_DELAY_MS:,})")  # fmt: skip
    parser.add_argument("--profile", metavar="FILE",
                        help="py-spy profiles of the proxy under the closed loop: FILE's stem + -ids / -text / -chat; "
                        "a .txt suffix writes collapsed stacks, others a flame graph")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, one run")
    parser.add_argument("--bare-relay", nargs="+", metavar="ARG", help=argparse.SUPPRESS)  # PORT URL...: baseline
    args = parser.parse_args(argv)
    try:
        outputs = profile_outputs(args.profile)
    except ValueError as exc:
        parser.error(f"argument --profile: {exc}")
    for output in outputs.values():  # checked now, not after the benchmark's minutes
        check_output(parser, output, "--profile")
    if args.bare_relay:
        port = args.bare_relay[0]
        if not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"argument --bare-relay: expected PORT URL..., a port in [1, 65535] first, not {port!r}")
        bare_relay(int(port), args.bare_relay[1:])
        return
    if args.quick:
        args.runs, args.requests, args.loop_requests, args.concurrency = 1, 20, 60, 4
        args.prompt_tokens = 256
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    server_cpus, other_cpus = set(cpus[:1]), set(cpus[1:] or cpus)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        tokenizer = build_tokenizer(folder)
        base = consecutive_free_ports(ENGINES)
        ports = {"direct": list(range(base, base + ENGINES)), "relay": [free_port()], "proxy": [free_port()]}
        backends = [f"http://127.0.0.1:{port}" for port in ports["direct"]]
        python = [sys.executable, "-m", "prefixroute"]
        engines = spawn([*python, "fake-engines", "--count", str(ENGINES), "--base-port", str(base),
                         "--prefill-us-per-token", "0", "--token-delay-ms", str(args.token_delay_ms),
                         "--max-tokens", str(args.answer_tokens)], "engines", folder)  # fmt: skip
        relay = spawn([sys.executable, __file__, "--bare-relay", str(ports["relay"][0]), *backends], "relay", folder)
        proxy = spawn([*python, "proxy", "--port", str(ports["proxy"][0]), "--tokenizer", str(tokenizer),
                       "--backends", *backends], "proxy", folder)  # fmt: skip
        with engines, relay, proxy:
            for port in ports["direct"]:
                wait_healthy(engines, f"http://127.0.0.1:{port}/health")
            wait_healthy(relay, f"http://127.0.0.1:{ports['relay'][0]}/healthz")
            wait_healthy(proxy, f"http://127.0.0.1:{ports['proxy'][0]}/healthz")
            pin(proxy.pid, server_cpus)
            pin(relay.pid, server_cpus)
            pin(engines.pid, other_cpus)
            pin(os.getpid(), other_cpus)
            print(f"{args.prompt_tokens}-token prompts, {args.answer_tokens} streamed tokens "
                  f"{args.token_delay_ms:g} ms apart, {ENGINES} fake engines; proxy and relay on CPU "
                  f"{sorted(server_cpus)}, engines and load on {sorted(other_cpus)}; "
                  f"median of {args.runs} runs")  # fmt: skip
            measure(args, ports, {"relay": relay, "proxy": proxy})


def measure(args: argparse.Namespace, ports: dict[str, list[int]], servers: dict[str, Process]) -> None:
    """Print the latency table and the requests/s table."""
    run_loop = _runner()
    print()
    print("Latency of a streamed completion; relay, proxy: added to direct (ms)")
    print(f"{'prompt':<6} {'metric':<6} {'direct P50':>11} {'relay P50':>10} {'proxy P50':>10} "
          f"{'direct P99':>11} {'relay P99':>10} {'proxy P99':>10}")  # fmt: skip
    for kind in KINDS:
        figures: dict[str, list[list[float]]] = {"TTFT": [], "total": []}
        for run in range(args.runs + 1):
            requests = make_requests(args, count=args.requests, kind=kind, seed=run)
            times = run_loop(latency_run(ports, requests))
            if run == 0:
                continue  # the warm-up
            for column, metric in enumerate(("TTFT", "total")):
                row = []
                for fraction in (0.5, 0.99):
                    direct = percentile(times["direct"][column], fraction)
                    row += [direct] + [percentile(times[w][column], fraction) - direct for w in ("relay", "proxy")]
                figures[metric].append(row)
        for metric, rows in figures.items():
            cells = " ".join(f"{statistics.median(r[i] for r in rows) * 1e3:>{w}.3f}"
                             for i, w in enumerate((11, 10, 10, 11, 10, 10)))  # fmt: skip
            print(f"{kind:<6} {metric:<6} {cells}")
    print()
    print(f"Closed loop, {args.concurrency} connections; per core = requests per CPU-second of the server process")
    print(f"{'prompt':<6} {'server':<6} {'requests/s (wall)':>18} {'CPU ms/request':>15} {'requests/s per core':>20}")
    for kind, way in (("ids", "relay"), ("ids", "proxy"), ("text", "proxy"), ("chat", "proxy")):
        server, port = servers[way], ports[way][0]
        rates: list[tuple[float, float]] = []
        for run in range(args.runs + 1):
            requests = make_requests(args, count=args.loop_requests, kind=kind, seed=100 + run)
            cpu, begin = server.cpu_seconds(), time.perf_counter()
            done = run_loop(closed_loop(port, requests, concurrency=args.concurrency))
            wall, cpu = time.perf_counter() - begin, server.cpu_seconds() - cpu
            if run:
                rates.append((done / wall, cpu / done))
        wall_rate = statistics.median(r[0] for r in rates)
        per_request = statistics.median(r[1] for r in rates)
        per_core = f"{1 / per_request:>20,.0f}" if per_request else f"{'n/a':>20}"
        print(f"{kind:<6} {way:<6} {wall_rate:>18,.0f} {per_request * 1e3:>15.3f} {per_core}")
    if args.profile:
        profile(args, ports["proxy"][0], servers["proxy"], run_loop)


def make_requests(args: argparse.Namespace, *, count: int, kind: str, seed: int) -> list[bytes]:
    bodies = prompts(count, tokens=args.prompt_tokens, seed=seed)
    return [request_bytes(p, kind=kind, answer_tokens=args.answer_tokens) for p in bodies]


def bare_relay(port: int, backends: list[str]) -> None:
    """The baseline server: aiohttp on uvloop passing requests through round robin (no JSON, no routing)."""
    import itertools

    import aiohttp
    from aiohttp import web

    turn = itertools.cycle(backends)
    sessions: list[aiohttp.ClientSession] = []

    async def relay(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {"Content-Type": "application/json"}
        async with sessions[0].post(next(turn) + request.path, data=raw, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def healthz(request: web.Request) -> web.Response:
        return web.Response()

    async def serve() -> None:
        sessions.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False))
        app = web.Application()
        app.router.add_post("/v1/completions", relay)
        app.router.add_post("/v1/chat/completions", relay)
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _runner()(serve())


_N = TypeVar("_N", int, float)
MAX_ANSWER_TOKENS = 1_000_000  # what the fake engines take (prefixroute fake-engines --max-tokens)
MAX_TOKEN_DELAY_MS = 60_000  # and --token-delay-ms


def at_most(kind: Callable[[str], _N], limit: _N) -> Callable[[str], _N]:
    """An argparse type: ``kind``'s value, refused past ``limit`` (what the fake engines it starts would refuse)."""

    def read(text: str) -> _N:
        value = kind(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"expected at most {limit:,}, not {text!r}")
        return value

    return read


def profile_outputs(profile: str | None) -> dict[str, Path]:
    """The file of each prompt kind's profile: ``--profile``'s stem + ``-ids`` (``-text``, ``-chat``), its suffix kept
    (``out/proxy.svg``: ``out/proxy-ids.svg``; ``prof``: ``prof-ids``); none without ``--profile``.

    Raises:
        ValueError: ``profile`` names no file (empty, blank, or a root such as ``/``).
    """
    if profile is None:
        return {}
    path = Path(profile)
    if not profile.strip() or not path.stem.strip():
        raise ValueError(f"give a file name, not {profile!r}")
    if path.is_dir():  # its stem would name files beside it: /tmp gave /tmp-ids
        raise ValueError(f"{profile!r} is a folder: give a file path, such as {str(path / 'proxy.svg')!r}")
    return {kind: path.with_name(f"{path.stem}-{kind}{path.suffix}") for kind in KINDS}


def profile(args: argparse.Namespace, proxy_port: int, proxy: Process, loop_runner: Runner) -> None:
    """Record a py-spy profile of the proxy under the closed loop, per prompt kind (``.txt``: collapsed stacks)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).is_file():
        print("py-spy is not installed: no profile")
        return
    for kind, output in profile_outputs(args.profile).items():
        requests = make_requests(args, count=args.loop_requests, kind=kind, seed=999)
        # Blocking samples (py-spy pauses the proxy for each): non-blocking ones read frames the proxy is changing
        # and put time on the wrong lines (7 % on one `+= 1` in the sidecar's profile).
        command = [spy, "record", "--pid", str(proxy.pid), "--output", str(output), "--rate", "500",
                   "--format", "raw" if output.suffix == ".txt" else "flamegraph"]  # fmt: skip
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)
        loop_runner(closed_loop(proxy_port, requests, concurrency=args.concurrency))
        recorder.send_signal(signal.SIGINT)
        _, err = recorder.communicate(timeout=60)
        print(f"profile: {output}" if Path(output).exists() else f"py-spy failed: {err.decode()[-500:]}")


def _runner() -> Runner:
    """Run coroutines on uvloop when it is installed (less of the load's own cost in the figures)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


if __name__ == "__main__":
    main()
