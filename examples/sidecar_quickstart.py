"""``prefixroute serve``, the decision sidecar, used the way a proxy uses it: three fake vLLM engines and the sidecar on
loopback; each request asks ``POST /route`` where to go, streams from that engine, reports ``POST /first_token`` on
its first chunk and ``POST /finish`` at the end. Requests that share a system prompt land on one engine and hit its
prefix cache. Runs offline in a few seconds: ``python examples/sidecar_quickstart.py``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx

from prefixroute.testing.openai_engine import OpenAIEngine

SYSTEMS = {"sql": list(range(1000, 1400)), "poems": list(range(2000, 2400)), "code": list(range(3000, 3400))}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_sidecar(backends: list[str], port: int) -> subprocess.Popen[bytes]:
    """``prefixroute serve --backends URL ... --port PORT``, returned once ``GET /healthz`` answers."""
    command = [sys.executable, "-m", "prefixroute", "serve", "--backends", *backends, "--port", str(port)]
    sidecar = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return sidecar
        except httpx.TransportError:
            if sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start") from None
            time.sleep(0.05)


def complete(client: httpx.Client, sidecar: str, prompt: list[int]) -> str:
    """One request as a proxy would serve it: route, stream from the chosen engine, report, finish."""
    decision = client.post(f"{sidecar}/route", json={"prompt_token_ids": prompt}).json()
    cached = 0
    try:
        request = {"model": "fake-model", "prompt": prompt, "max_tokens": 4, "stream": True,
                   "stream_options": {"include_usage": True}}  # fmt: skip
        with client.stream("POST", f"{decision['backend']}/v1/completions", json=request) as reply:
            first = True
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first:
                    client.post(f"{sidecar}/first_token", json={"id": decision["id"]})
                    first = False
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    finally:
        client.post(f"{sidecar}/finish", json={"id": decision["id"]})  # idempotent: safe in finally
    return (f"-> {decision['backend']} ({decision['reason']}, {decision['matched_tokens']}/"
            f"{decision['prompt_tokens']} tokens matched; engine cached {cached})")  # fmt: skip


def main() -> None:
    engines = [OpenAIEngine(seed=i, max_tokens=4).start() for i in range(3)]
    port = free_port()
    sidecar = start_sidecar([engine.url for engine in engines], port)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=10) as client:
            for turn in range(3):
                for name, system in SYSTEMS.items():
                    print(f"{name:>5} question {turn} {complete(client, url, [*system, 5000 + turn, 6000 + turn])}")
            stats = client.get(f"{url}/stats").json()
            print(f"decisions by reason {stats['decisions']}, in flight now {stats['in_flight_total']}")
    finally:
        sidecar.terminate()
        sidecar.wait()
        for engine in engines:
            engine.stop()


if __name__ == "__main__":
    main()
