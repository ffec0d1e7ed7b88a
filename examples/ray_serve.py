"""Prefix-aware routing inside Ray Serve: one deployment of three replicas, ranked by prefixroute.

Runs offline on a local Ray (about 15 s, most of it Ray starting): ``python examples/ray_serve.py`` (needs
``prefixroute[ray]``). Each replica stands in for a vLLM server and answers with its replica id; requests that share
a system prompt land on the same replica, and every in-flight count is back to 0 at the end. On a cluster, the same
deployment runs unchanged (see docs/adapters.md, "Ray Serve").
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, cast

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from prefixroute.adapters.ray import PrefixRouteRequestRouter

SYSTEMS = [list(range(1000 * g, 1000 * g + 256)) for g in range(1, 4)]  # three 256-token system prompts (token ids)


@serve.deployment(
    num_replicas=3,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class=cast(Any, "prefixroute.adapters.ray:PrefixRouteRequestRouter"),  # Ray types it narrowly
        request_router_kwargs={"block_size": 16},  # the default policy; add "tokenizer" for text prompts
    ),
)
class Engine:
    """A stand-in for an LLM server: answers with the id of the replica that served the request."""

    async def __call__(self, body: dict[str, Any]) -> str:
        return str(serve.get_replica_context().replica_id.unique_id)


def settle(handle: DeploymentHandle[Any]) -> PrefixRouteRequestRouter:
    """Wait for Ray's completion notices, which it sends from its own loop a moment after each result; return the
    handle's router (Ray builds it on the first call).

    Ray reports no first token, so until its notice lands a finished request still counts in flight with its whole
    prompt as pending prefill, and the default policy would send the next request on that prefix elsewhere.
    """
    router = handle._router._asyncio_router.request_router  # type: ignore[union-attr]  # Ray's internals
    assert isinstance(router, PrefixRouteRequestRouter)
    deadline = time.monotonic() + 10
    while router.router.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return router


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")  # calls go through handles: no HTTP proxy actor to start
        handle = serve.run(Engine.bind(), name="prefixroute-example")  # type: ignore[attr-defined]
        placed: Counter[tuple[int, str]] = Counter()
        for question in range(4):
            for group, system in enumerate(SYSTEMS):
                replica = handle.remote({"prompt": [*system, 5000 + question]}).result()
                placed[group, replica] += 1
                router = settle(handle)
        for (group, replica), count in sorted(placed.items()):
            print(f"system prompt {group}: {count} requests on replica {replica}")
        stats = router.router.stats()
        print(f"decisions: {stats.decisions}, in flight now: {stats.in_flight}")
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


if __name__ == "__main__":
    main()
