"""``prefixroute proxy`` in front of three fake vLLM engines, all on loopback: requests that share a system prompt
land on one engine and hit its prefix cache. Runs offline: ``python examples/proxy_quickstart.py``."""

from __future__ import annotations

import httpx

from prefixroute import Router
from prefixroute.adapters.proxy import Proxy
from prefixroute.testing.openai_engine import OpenAIEngine

SYSTEMS = ["You answer questions about SQL. " * 30, "You write short poems. " * 30, "You review Python code. " * 30]


def main() -> None:
    engines = [OpenAIEngine(seed=i, max_tokens=4).start() for i in range(3)]
    try:
        with Proxy(Router(), [engine.url for engine in engines]) as proxy, httpx.Client(base_url=proxy.url) as client:
            for turn in range(3):
                for system in SYSTEMS:
                    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]
                    reply = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": messages})
                    usage = reply.json()["usage"]
                    details = usage.get("prompt_tokens_details") or {}  # vLLM's: null when nothing was cached
                    cached = f"{details.get('cached_tokens', 0)}/{usage['prompt_tokens']}"
                    where = f"{reply.headers['x-prefixroute-backend']} ({reply.headers['x-prefixroute-reason']})"
                    print(f"{system[:14]!r:18} -> {where}, engine cached {cached} tokens")
            print(client.get("/metrics").text.splitlines()[1])
    finally:
        for engine in engines:
            engine.stop()


if __name__ == "__main__":
    main()
