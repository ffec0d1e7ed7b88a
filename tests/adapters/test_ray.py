"""The Ray Serve request router on a local Ray: one deployment of three replicas, routed by prefixroute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from prefixroute.adapters.ray import PrefixRouteRequestRouter

PREFIX = list(range(1000, 1064))
Handle = DeploymentHandle[Any]


@serve.deployment(
    num_replicas=3,
    max_ongoing_requests=32,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class=cast(Any, "prefixroute.adapters.ray:PrefixRouteRequestRouter"),  # typed too narrowly
        request_router_kwargs={"policy": "bounded-load", "block_size": 16},
    ),
)
class Replica:
    """Answers with its replica id, after ``sleep`` seconds; ``fail`` raises."""

    async def __call__(self, body: dict[str, Any]) -> str:
        await asyncio.sleep(body.get("sleep", 0))
        if body.get("fail"):
            raise RuntimeError("the engine failed")
        return str(serve.get_replica_context().replica_id.unique_id)


@pytest.fixture(scope="module")
def handle() -> Iterator[Handle]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield serve.run(
            Replica.bind(),  # type: ignore[attr-defined]  # serve.deployment's class
            name="prefixroute-test",
        )
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def request_router(handle: Handle) -> PrefixRouteRequestRouter:
    router = handle._router._asyncio_router.request_router  # type: ignore[union-attr]  # Ray's internals
    assert isinstance(router, PrefixRouteRequestRouter)
    return router


def settled(handle: Handle) -> PrefixRouteRequestRouter:
    """Every counter back to exactly 0 (Ray reports completion from its own loop, a moment after the result)."""
    router = request_router(handle)
    deadline = time.monotonic() + 10
    while router.router.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert router.router.stats().in_flight == 0 and not router._started
    backends = list(router.router.index.backends()) or ["x"]
    for candidate in router.router.decide([1] * 64, backends).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)
    return router


def test_the_same_prefix_goes_to_the_same_replica(handle: Handle) -> None:
    replicas = {handle.remote({"prompt": [*PREFIX, i]}).result() for i in range(5)}
    chat = [{"role": "system", "content": "You are terse. " * 20}]
    chats = {handle.remote({"messages": [*chat, {"role": "user", "content": str(i)}]}).result() for i in range(3)}
    assert len(replicas) == 1 and len(chats) == 1
    router = settled(handle)
    assert router.router.stats().commits >= 8


def test_load_spills_to_other_replicas_under_concurrency(handle: Handle) -> None:
    responses = [handle.remote({"prompt": [*PREFIX, 7, i], "sleep": 1.0}) for i in range(9)]
    router = request_router(handle)
    deadline = time.monotonic() + 10
    while router.router.stats().in_flight < 9 and time.monotonic() < deadline:
        time.sleep(0.01)
    replicas = [response.result() for response in responses]
    assert len(set(replicas)) > 1 and max(replicas.count(r) for r in replicas) < 9
    settled(handle)


def test_a_failed_request_is_finished(handle: Handle) -> None:
    with pytest.raises(RuntimeError, match="the engine failed"):
        handle.remote({"prompt": PREFIX, "fail": True}).result()
    settled(handle)


def test_requests_without_a_prompt_are_ranked_by_ray_alone(handle: Handle) -> None:
    decisions = request_router(handle).router.stats().decisions
    assert handle.remote({"sleep": 0}).result()
    assert request_router(handle).router.stats().decisions == decisions
