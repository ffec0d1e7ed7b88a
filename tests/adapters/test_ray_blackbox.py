"""The Ray Serve request router as a user meets it, on one local Ray (one module fixture: starting Ray is most of
the cost): chat bodies of every shape, ``body=`` given by keyword, and a replica that dies with requests in flight."""

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

from .conftest import tool_call_conversation

Handle = DeploymentHandle[Any]


@serve.deployment(
    num_replicas=3,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class=cast(Any, "prefixroute.adapters.ray:PrefixRouteRequestRouter"),  # typed too narrowly
        request_router_kwargs={"block_size": 16},
    ),
)
class Engine:
    """Answers with its replica id after ``sleep`` seconds."""

    async def __call__(self, body: dict[str, Any]) -> str:
        await asyncio.sleep(body.get("sleep", 0))
        return str(serve.get_replica_context().replica_id.unique_id)


@pytest.fixture(scope="module")
def handle() -> Iterator[Handle]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        yield serve.run(Engine.bind(), name="prefixroute-blackbox")  # type: ignore[attr-defined]
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def settled(handle: Handle) -> PrefixRouteRequestRouter:
    """The handle's router once Ray's completion notices have landed, every count back to exactly 0."""
    router = handle._router._asyncio_router.request_router  # type: ignore[union-attr]  # Ray's internals
    assert isinstance(router, PrefixRouteRequestRouter)
    deadline = time.monotonic() + 10
    while router.router.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert router.router.stats().in_flight == 0
    backends = sorted(router.router.index.backends()) or ["none"]
    for candidate in router.router.decide([1] * 64, backends).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)
    return router


def test_chat_bodies_of_every_shape_and_a_body_by_keyword_route_on_their_prefix(handle: Handle) -> None:
    conversation = tool_call_conversation()
    handle.remote({"prompt": "warm up"}).result()
    router = settled(handle)
    commits = router.router.stats().commits
    places = set()
    for turn in range(4):
        body = {"messages": [*conversation, {"role": "user", "content": f"and then {turn}?"}]}
        reply = handle.remote(body=body) if turn % 2 else handle.remote(body)
        places.add(reply.result())
        settled(handle)
    assert len(places) == 1
    assert router.router.stats().commits == commits + 4
    assert router.errors == 0


def test_a_replica_that_dies_with_requests_in_flight_is_forgotten_and_counts_end(handle: Handle) -> None:
    body = {"prompt": list(range(5000, 5128))}
    home = handle.remote(body).result()
    router = settled(handle)
    assert home in router.router.index.backends()
    slow = [handle.remote({**body, "sleep": 30}) for _ in range(2)]
    time.sleep(0.5)
    assert router.router.stats().in_flight == 2
    [name] = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_REPLICA") and actor["name"].endswith(home)
    ]
    ray.kill(ray.get_actor(name, namespace="serve"))
    for reply in slow:
        with pytest.raises(ray.exceptions.ActorDiedError):
            reply.result(timeout_s=20)
    router = settled(handle)
    deadline = time.monotonic() + 10  # Ray tells its router of the death on its own loop, a moment later
    while home in router.router.index.backends() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert home not in router.router.index.backends()
    assert handle.remote(body).result() != home
    settled(handle)
    assert router.errors == 0
