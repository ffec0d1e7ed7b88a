"""The sidecar's decision rate and latency, and the CPU a proxy spends per request with and without it.

Method. ``prefixroute serve`` runs in its own process pinned to one core (CPU 0); a separate load process pinned to
the other cores sends ``POST /route`` over 32 keep-alive loopback connections. The load process is plain sockets
under one epoll loop (no asyncio: its timers round up to the millisecond, which alone put ~0.8 ms at P50 and ~4 ms at
P99 into every figure), and it spins for the last 1.5 ms before each send, so requests leave on time. *Rate*:
closed loop, as fast as the sidecar answers, decisions per second over the run. *Latency*: open loop at half that
rate, P50/P99 from when each request was due (so the load process's own lateness counts against it, never hides a
queue) to its answer. *Floor*: the same open loop against a server that answers at once without reading the body
(uvloop, pinned where the sidecar was): what the load process and loopback add to every latency figure. Prompts of
2K and 8K tokens, as token ids and as text (a word-level tokenizer built here, 1 token per word), each a shared
1K/4K-token prefix of one of 8 system prompts plus a unique suffix; requests carry ``"lease": 1`` so the in-flight
counts stay bounded. Each figure is the median of ``--runs`` runs after a warm-up. *Proxy CPU*: user+system CPU of
the proxy's processes (from /proc) per request for non-streaming completions to fake engines, with the sidecar (the
example configuration), with the sidecar down (the same configuration failing open), and the example without its
sidecar call (nginx: a plain ``proxy_pass``; HAProxy: no Lua action; Envoy: no ext_proc filter).

The machine has 2 cores, so the sidecar's core and the load's are the whole machine: anything else running (other
test suites) takes from one of them, and P99 shows it first. Each run prints the 1-minute load average beside it.

Run: ``python benchmarks/bench_sidecar.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from itertools import repeat
from pathlib import Path
from typing import Any

import httpx
from _args import Parser, positive_float, positive_int

from prefixroute.adapters.serve.loopback import (
    Process,
    find_binary,
    free_port,
    start_envoy,
    start_haproxy,
    start_nginx,
    start_sidecar,
)

CONNECTIONS = 32
PLAIN_NGINX = """upstream vllm_pool { least_conn; server 127.0.0.1:8001; server 127.0.0.1:8002; keepalive 32; }
server {
    listen 127.0.0.1:8080;
    location / { proxy_pass http://vllm_pool; proxy_http_version 1.1; proxy_set_header Connection ""; }
}
"""


def build_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [f"w{i}" for i in range(4000)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    del trainers
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def bodies(tokens: int, *, text: bool, count: int = 64, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 4000) for _ in range(tokens // 2)] for _ in range(8)]
    out = []
    for _ in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 4000) for _ in range(tokens - tokens // 2)]
        if text:
            payload: dict[str, Any] = {"prompt": " ".join(f"w{t}" for t in prompt), "lease": 1}
        else:
            payload = {"prompt_token_ids": prompt, "lease": 1}
        out.append(json.dumps(payload).encode())
    return out


def request_bytes(body: bytes) -> bytes:
    head = (
        "POST /route HTTP/1.1\r\nhost: sidecar\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _connect(port: int, request: bytes) -> socket.socket:
    """A keep-alive connection that has carried one request (so the server has accepted it before timing)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(request)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0 or len(data) < end + 4 + _length(data, end):
        data += sock.recv(1 << 16)
    sock.setblocking(False)
    return sock


def _length(data: bytes, head_end: int) -> int:
    at = data.find(b"content-length: ", 0, head_end)
    return int(data[at + 16 : data.find(b"\r\n", at)])


def _load(port: int, requests: list[bytes], seconds: float, rate: float | None) -> dict[str, Any]:
    """Send ``requests`` (round robin) for ``seconds``: closed loop (``rate`` None) or open loop at ``rate``/s.

    One epoll loop over raw keep-alive sockets, one request outstanding per connection. Open loop: requests fall due
    every 1/rate s; a due request waits in a backlog for a free connection, and its latency counts from when it was
    due. The loop sleeps in epoll until 1.5 ms before the next due time and then spins (epoll's timeout is in ms).
    """
    sockets = [_connect(port, requests[0]) for _ in range(CONNECTIONS)]
    poller = select.epoll()
    by_fd = {}
    for i, sock in enumerate(sockets):
        poller.register(sock.fileno(), select.EPOLLIN)
        by_fd[sock.fileno()] = i
    free = deque(range(CONNECTIONS))
    due_at = [0.0] * CONNECTIONS
    partial = [b""] * CONNECTIONS
    backlog: deque[float] = deque()
    latencies: list[float] = []
    clock = time.perf_counter
    sent = outstanding = 0
    started = clock()
    deadline = started + seconds
    next_due = started
    interval = 0.0 if rate is None else 1.0 / rate
    while True:
        now = clock()
        if rate is None:
            if now < deadline:
                backlog.extend(repeat(now, len(free)))
        else:
            while next_due <= now and next_due < deadline:
                backlog.append(next_due)
                next_due += interval
        while backlog and free:
            i = free.popleft()
            sockets[i].send(requests[sent % len(requests)])
            due_at[i] = backlog.popleft()
            sent += 1
            outstanding += 1
        if now >= deadline and not outstanding:
            break
        wait = 0.05 if rate is None or next_due >= deadline else next_due - clock()
        for fd, _ in poller.poll(0 if wait < 0.0015 else wait - 0.0011):
            i = by_fd[fd]
            data = partial[i] + sockets[i].recv(1 << 16)
            head_end = data.find(b"\r\n\r\n")
            if head_end < 0 or len(data) < head_end + 4 + _length(data, head_end):
                partial[i] = data
                continue
            if not data.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(data[:head_end].decode())
            partial[i] = b""
            latencies.append(clock() - due_at[i])
            outstanding -= 1
            free.append(i)
    elapsed = clock() - started
    for sock in sockets:
        sock.close()
    poller.close()
    return {"rate": len(latencies) / elapsed, "latencies": latencies}


def _load_process(port: int, requests: list[bytes], seconds: float, rate: float | None, out: Any) -> None:
    os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)) or {0})
    out.send(_load(port, requests, seconds, rate))


def load(port: int, requests: list[bytes], seconds: float, rate: float | None = None) -> dict[str, Any]:
    """Run the load in a separate process (spawned, pinned off CPU 0) and return its figures."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_load_process, args=(port, requests, seconds, rate, send))
    process.start()
    result: dict[str, Any] = receive.recv()
    process.join()
    return result


INSTANT_SERVER = """
import asyncio, os, sys, uvloop
os.sched_setaffinity(0, {0})
ANSWER = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: 2\\r\\n\\r\\n{}"
class Instant(asyncio.Protocol):
    def connection_made(self, transport): self.transport, self.data = transport, b""
    def data_received(self, data):
        self.data += data
        while (end := self.data.find(b"\\r\\n\\r\\n")) >= 0:
            at = self.data.find(b"content-length: ", 0, end)
            size = end + 4 + int(self.data[at + 16 : self.data.find(b"\\r\\n", at)])
            if len(self.data) < size: return
            self.data = self.data[size:]
            self.transport.write(ANSWER)
async def main():
    await asyncio.get_running_loop().create_server(Instant, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""
"""A server that answers every request at once: the latency floor of the load process and loopback."""


def floor(rate: float, requests: list[bytes], *, runs: int, seconds: float) -> tuple[float, float]:
    """Median P50 and P99 (ms) of the open loop at ``rate`` against :data:`INSTANT_SERVER`."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", INSTANT_SERVER, str(port)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        p50s, p99s = [], []
        for _ in range(runs):
            latencies = load(port, requests, seconds, rate)["latencies"]
            p50s.append(percentile(latencies, 0.5) * 1000)
            p99s.append(percentile(latencies, 0.99) * 1000)
        return statistics.median(p50s), statistics.median(p99s)
    finally:
        server.terminate()
        server.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_decisions(workdir: Path, *, runs: int, seconds: float, quick: bool) -> None:
    tokenizer = build_tokenizer(workdir)
    port = free_port()
    backends = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]
    print(f"POST /route, sidecar on one core, {CONNECTIONS} connections, median of {runs} runs of {seconds:g} s")
    print(f"{'prompt':>8} {'as':>5} {'decisions/s':>12} {'P50 ms':>8} {'P99 ms':>8}   (latency at half the rate)"
          f"  floor P50/P99 ms  load avg")  # fmt: skip
    with start_sidecar(workdir, backends, port=port, options=["--tokenizer", str(tokenizer)]) as sidecar:
        os.sched_setaffinity(sidecar.pid, {0})
        for tokens in (2048, 8192):
            for text in (False, True):
                requests = [request_bytes(b) for b in bodies(tokens, text=text, count=16 if quick else 64)]
                load(port, requests, min(seconds, 1.0))  # warm-up
                rates = [load(port, requests, seconds)["rate"] for _ in range(runs)]
                rate = statistics.median(rates)
                p50s, p99s = [], []
                for _ in range(runs):
                    latencies = load(port, requests, seconds, rate / 2)["latencies"]
                    p50s.append(percentile(latencies, 0.5) * 1000)
                    p99s.append(percentile(latencies, 0.99) * 1000)
                kind = "text" if text else "ids"
                print(f"{tokens:>8} {kind:>5} {rate:>12,.0f} {statistics.median(p50s):>8.2f} "
                      f"{statistics.median(p99s):>8.2f}", end="", flush=True)  # fmt: skip
                floor_p50, floor_p99 = floor(rate / 2, requests, runs=runs, seconds=seconds)
                print(f"  {floor_p50:>7.3f} / {floor_p99:.3f}  {os.getloadavg()[0]:>9.2f}")


PLAIN = {
    "haproxy": lambda text: re.sub(r"\n *http-request lua\.prefixroute_pick[^\n]*", "", text),
    "envoy": lambda text: re.sub(
        r"\n( *)- name: envoy\.filters\.http\.ext_proc\n.*?(?=\n\1- name: )", "", text, flags=re.S
    ),
}
"""Each example configuration without its sidecar call (the nginx counterpart is :data:`PLAIN_NGINX`)."""


def proxy_cpu(workdir: Path, *, requests: int) -> None:
    from prefixroute.testing.openai_engine import OpenAIEngine

    print(f"\nproxy CPU per request (non-streaming completions, {requests} requests, sequential)")
    print(f"{'proxy':>8} {'set-up':>28} {'CPU us/request':>15}")
    with OpenAIEngine(max_tokens=1) as engine0, OpenAIEngine(max_tokens=1) as engine1:
        for name, starter in (("nginx", start_nginx), ("haproxy", start_haproxy), ("envoy", start_envoy)):
            if find_binary(name) is None:
                print(f"{name:>8} {'(not installed)':>28}")
                continue
            folder = Path(tempfile.mkdtemp(dir=workdir))
            ports = {"proxy": free_port(), "engine0": int(engine0.url.rsplit(":", 1)[1]),
                     "engine1": int(engine1.url.rsplit(":", 1)[1]), "sidecar": free_port(), "release": free_port(),
                     "ext_proc": free_port()}  # fmt: skip
            options = ["--release-port", str(ports["release"]), "--ext-proc", str(ports["ext_proc"])]
            sidecar = start_sidecar(folder, [engine0.url, engine1.url], port=ports["sidecar"], options=options)
            proxy = starter(folder, ports)
            try:
                print(f"{name:>8} {'with the sidecar':>28} {_cpu(proxy, ports['proxy'], requests):>15.0f}")
                sidecar.stop()
                print(f"{name:>8} {'sidecar down (fail-open)':>28} {_cpu(proxy, ports['proxy'], requests):>15.0f}")
            finally:
                proxy.stop()
                sidecar.stop()
            folder = Path(tempfile.mkdtemp(dir=workdir))
            if name == "nginx":
                plain = start_nginx(folder, ports, site=PLAIN_NGINX)
            elif name == "haproxy":
                plain = start_haproxy(folder, ports, edit=PLAIN["haproxy"])
            else:
                plain = start_envoy(folder, ports, edit=PLAIN["envoy"])
            with plain:
                print(f"{name:>8} {'without the sidecar call':>28} {_cpu(plain, ports['proxy'], requests):>15.0f}")


def _cpu(proxy: Process, port: int, requests: int) -> float:
    body = {"model": "fake-model", "prompt": list(range(512)), "max_tokens": 1}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        for _ in range(20):
            client.post("/v1/completions", json=body)
        before = proxy.cpu_seconds()
        for i in range(requests):
            body["prompt"] = [i % 8, *range(511)]
            assert client.post("/v1/completions", json=body).status_code == 200
        return (proxy.cpu_seconds() - before) / requests * 1e6


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: short, one run")
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--seconds", type=positive_float, default=3.0)
    parser.add_argument("--no-proxies", action="store_true", help="skip the proxy CPU figures")
    args = parser.parse_args()
    runs, seconds = (1, 0.5) if args.quick else (args.runs, args.seconds)
    with tempfile.TemporaryDirectory() as folder:
        bench_decisions(Path(folder), runs=runs, seconds=seconds, quick=args.quick)
        if not args.no_proxies:
            proxy_cpu(Path(folder), requests=200 if args.quick else 2000)


if __name__ == "__main__":
    main()
