"""Keep the router's index exact with vLLM's KV-cache events, and feed it the engines' load from ``/metrics``.

Real vLLM needs a GPU, so this runs two ``prefixroute.testing.FakeVLLM`` engines on loopback: they speak vLLM's
wire formats (ZMQ KV events with replay, Prometheus ``/metrics``). Against real engines, pass their addresses
instead: ``router.subscribe("http://gpu0:8000", "tcp://gpu0:5557", replay_endpoint="tcp://gpu0:5558")``.
Needs the ``prefixroute[vllm]`` extra.

Run: ``python examples/vllm_events.py``
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from prefixroute import Router
from prefixroute.testing import FakeVLLM


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    rng = random.Random(3)
    system_prompt = [rng.randrange(32_000) for _ in range(512)]
    with FakeVLLM(num_blocks=256) as gpu0, FakeVLLM(num_blocks=256) as gpu1:
        engines = {"gpu0": gpu0, "gpu1": gpu1}
        router = Router(block_size=16)
        for name, engine in engines.items():
            router.subscribe(name, engine.endpoint, replay_endpoint=engine.replay_endpoint)
        poller = router.watch_metrics({name: engine.url for name, engine in engines.items()}, interval=0.1)
        try:
            # gpu1 served the system prompt before this router existed: only its events can tell.
            gpu1.complete(system_prompt)
            wait_for(lambda: router.index.blocks("gpu1") >= 32, "gpu1's KV events")
            prompt = system_prompt + [rng.randrange(32_000) for _ in range(40)]
            decision = router.route(prompt, list(engines))
            print(f"route: {decision.backend} ({decision.reason}), predicted {decision.matched_tokens} cached tokens,")
            print(f"       {decision.confirmed_tokens} confirmed by the engine's KV events")
            served = engines[decision.backend].complete(prompt)
            print(f"engine: {served.cached_tokens} of {served.prompt_tokens} prompt tokens came from its cache")

            gpu0.set_load(running=4, waiting=3)
            wait_for(lambda: poller.load("gpu0")[0] == 3, "a scrape of gpu0's /metrics")
            seen = {c.backend: (c.queue_len, c.kv_usage) for c in router.route(prompt, list(engines)).candidates}
            print("engine load the policy sees (waiting, KV usage):", seen)
            print("block size and GPU blocks from vllm:cache_config_info:", poller.cache_config("gpu0"))
            print("healthy engines:", poller.healthy_backends(list(engines)))
        finally:
            router.close()


if __name__ == "__main__":
    main()
