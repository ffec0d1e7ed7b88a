"""Keep the router's index exact with vLLM's KV-cache events, and feed it the engines' load from ``/metrics``.

Real vLLM needs a GPU, so this runs two ``prefixroute.testing.FakeVLLM`` engines on loopback: they speak vLLM's
wire formats (ZMQ KV events with replay, Prometheus ``/metrics``). Against real engines, pass their addresses
instead: ``fleet.add_backend("http://gpu0:8000", kv_events="tcp://gpu0:5557", replay="tcp://gpu0:5558",
metrics_url="http://gpu0:8000")``. Needs the ``prefixroute[vllm]`` extra.

Run: ``python examples/vllm_events.py``
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from prefixroute import Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, Fleet


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    rng = random.Random(3)
    system_prompt = [rng.randrange(32_000) for _ in range(512)]
    # The events write the index; a just-routed prompt is trusted for 3-6 s until its events arrive.
    router = Router(block_size=16, index=EventIndex(16, speculative_ttl=3.0))
    with FakeVLLM(num_blocks=256) as gpu0, FakeVLLM(num_blocks=256) as gpu1, Fleet(router, interval=0.1) as fleet:
        engines = {"gpu0": gpu0, "gpu1": gpu1}
        for name, engine in engines.items():
            fleet.add_backend(name, kv_events=engine.endpoint, replay=engine.replay_endpoint, metrics_url=engine.url)
        # gpu1 served the system prompt before this router existed: only its events can tell.
        gpu1.complete(system_prompt)
        wait_for(lambda: router.index.blocks("gpu1") >= 32, "gpu1's KV events")
        prompt = system_prompt + [rng.randrange(32_000) for _ in range(40)]
        decision = router.route(prompt, fleet.healthy_backends())
        print(f"route: {decision.backend} ({decision.reason}), predicted {decision.matched_tokens} cached tokens,")
        print(f"       {decision.confirmed_tokens} confirmed by the engine's KV events")
        served = engines[decision.backend].complete(prompt)
        print(f"engine: {served.cached_tokens} of {served.prompt_tokens} prompt tokens came from its cache")

        gpu0.set_load(running=4, waiting=3)
        wait_for(lambda: fleet.stats()["gpu0"].queue_len == 3, "a scrape of gpu0's /metrics")
        seen = {c.backend: (c.queue_len, c.kv_usage) for c in router.decide(prompt, list(engines)).candidates}
        print("engine load the policy sees (waiting, KV usage):", seen)
        gpu0_stats = fleet.stats()["gpu0"]
        print("block size and GPU blocks from vllm:cache_config_info:", (gpu0_stats.engine_block_size,
              gpu0_stats.num_gpu_blocks))  # fmt: skip
        print("healthy engines:", fleet.healthy_backends())
        fleet.remove_backend("gpu1")  # stops its subscriber and poller; the router forgets it
        print("after removing gpu1:", fleet.backends(), "- gpu1 blocks in the index:", router.index.blocks("gpu1"))


if __name__ == "__main__":
    main()
