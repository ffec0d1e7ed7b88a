"""The sidecar's decision rate and latency, and the CPU a proxy spends per request with and without it.

Method. ``prefixroute serve`` runs in its own process pinned to one core (CPU 0); a separate load process (pinned
elsewhere) sends ``POST /route`` over 32 keep-alive loopback connections with raw sockets. *Rate*: closed loop, as
fast as the sidecar answers, decisions per second over the run. *Latency*: open loop at half that rate, P50/P99 of
each request's round trip as the client sees it. Prompts of 2K and 8K tokens, as token ids and as text (a BPE
tokenizer trained here, ~1 token per word), each a shared 1K/4K-token prefix of one of 8 system prompts plus a
unique suffix; requests carry ``"lease": 1`` so the in-flight counts stay bounded. Each figure is the median of
``--runs`` runs after a warm-up. *Proxy CPU*: user+system CPU of the proxy's processes (from /proc) per request for
non-streaming completions to fake engines, with the sidecar (the example configuration) and with the sidecar down
(the same configuration failing open to its plain balancer), and for nginx a plain ``proxy_pass`` configuration.

Run: ``python benchmarks/bench_sidecar.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

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


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
    await reader.readexactly(length)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode())


async def _load(port: int, requests: list[bytes], seconds: float, rate: float | None) -> dict[str, Any]:
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CONNECTIONS)]
    latencies: list[float] = []
    done = 0
    deadline = time.perf_counter() + seconds

    async def closed(i: int) -> None:
        nonlocal done
        reader, writer = connections[i]
        k = i
        while time.perf_counter() < deadline:
            await _one(reader, writer, requests[k % len(requests)])
            k += CONNECTIONS
            done += 1

    async def opened() -> None:
        nonlocal done
        assert rate is not None
        free = asyncio.Queue[int]()
        for i in range(CONNECTIONS):
            free.put_nowait(i)
        start = time.perf_counter()
        tasks = []

        async def send(k: int, due: float) -> None:
            nonlocal done
            i = await free.get()
            reader, writer = connections[i]
            await _one(reader, writer, requests[k % len(requests)])
            latencies.append(time.perf_counter() - due)
            done += 1
            free.put_nowait(i)

        k = 0
        while True:
            due = start + k / rate
            if due > deadline:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(send(k, due)))
            k += 1
        await asyncio.gather(*tasks)

    started = time.perf_counter()
    if rate is None:
        await asyncio.gather(*(closed(i) for i in range(CONNECTIONS)))
    else:
        await opened()
    elapsed = time.perf_counter() - started
    for _, writer in connections:
        writer.close()
    return {"rate": done / elapsed, "latencies": latencies}


def _load_process(port: int, requests: list[bytes], seconds: float, rate: float | None, out: Any) -> None:
    os.sched_setaffinity(0, set(range(1, os.cpu_count() or 2)) or {0})
    out.send(asyncio.run(_load(port, requests, seconds, rate)))


def load(port: int, requests: list[bytes], seconds: float, rate: float | None = None) -> dict[str, Any]:
    """Run the load in a separate process (spawned) and return its figures."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_load_process, args=(port, requests, seconds, rate, send))
    process.start()
    result: dict[str, Any] = receive.recv()
    process.join()
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_decisions(workdir: Path, *, runs: int, seconds: float, quick: bool) -> None:
    tokenizer = build_tokenizer(workdir)
    port = free_port()
    backends = [f"http://10.0.0.{i}:8000" for i in range(1, 9)]
    print(f"POST /route, sidecar on one core, {CONNECTIONS} connections, median of {runs} runs of {seconds:g} s")
    print(f"{'prompt':>8} {'as':>5} {'decisions/s':>12} {'P50 ms':>8} {'P99 ms':>8}   (latency at half the rate)")
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
                      f"{statistics.median(p99s):>8.2f}")  # fmt: skip


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
            if name == "nginx":
                plain = PLAIN_NGINX
                folder = Path(tempfile.mkdtemp(dir=workdir))
                with start_nginx(folder, ports, site=plain) as proxy:
                    print(f"{name:>8} {'plain proxy_pass':>28} {_cpu(proxy, ports['proxy'], requests):>15.0f}")


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: short, one run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--no-proxies", action="store_true", help="skip the proxy CPU figures")
    args = parser.parse_args()
    runs, seconds = (1, 0.5) if args.quick else (args.runs, args.seconds)
    with tempfile.TemporaryDirectory() as folder:
        bench_decisions(Path(folder), runs=runs, seconds=seconds, quick=args.quick)
        if not args.no_proxies:
            proxy_cpu(Path(folder), requests=200 if args.quick else 2000)


if __name__ == "__main__":
    main()
