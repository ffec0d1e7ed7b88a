"""The Ray Serve request router on a local Ray: one deployment of three replicas, routed by prefixroute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from prefixroute import Candidate, LoadPolicy
from prefixroute.adapters.ray import PrefixRouteRequestRouter
from prefixroute.errors import ConfigurationError

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


# -- hostile calls, without a cluster: Ray's callbacks driven by hand ------------------------------------------------


class Exploding(LoadPolicy):
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        raise RuntimeError("policy bug")


def bare(**kwargs: Any) -> PrefixRouteRequestRouter:
    router = object.__new__(PrefixRouteRequestRouter)  # Ray's constructor wants a running deployment
    router._replicas, router._replicas_list, router._replica_id_set = {}, [], set()
    router._queue_len_gauge_last_update = {}
    router.initialize_state(**kwargs)
    return router


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


def replica(name: str) -> Any:
    return SimpleNamespace(replica_id=FakeReplicaID(name))


def pending(request_id: str, body: Any) -> Any:
    return SimpleNamespace(args=[body], kwargs={}, metadata=SimpleNamespace(internal_request_id=request_id))


REPLICAS = [replica(f"r{i}") for i in range(3)]


def zero(router: PrefixRouteRequestRouter) -> None:
    assert router.router.stats().in_flight == 0 and not router._started
    for candidate in router.router.decide([1] * 64, ["r0", "r1", "r2"]).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)


def test_bad_request_router_kwargs_raise_when_given() -> None:
    for lease in (0, -1, "600", float("inf")):
        with pytest.raises(ConfigurationError, match="lease"):
            bare(lease=lease)
    with pytest.raises(TypeError, match="tokenizer"):
        bare(tokenizer=5)
    with pytest.raises(ConfigurationError, match="policy"):
        bare(policy="no-such-policy")
    assert bare(lease=None)._lease is None


def test_a_policy_that_raises_keeps_rays_ranking() -> None:
    router = bare(policy=f"{__name__}:Exploding")
    ranks = asyncio.run(router.choose_replicas(REPLICAS, pending("a", {"prompt": PREFIX})))
    assert ranks == [REPLICAS] and router.errors == 1
    assert router.router.stats().in_flight == 0 and not router._decided


def test_hostile_callbacks_leave_every_count_at_zero() -> None:
    router = bare(policy="bounded-load")

    async def choose(request_id: str, body: Any = None, replicas: Any = REPLICAS) -> Any:
        return await router.choose_replicas(replicas, pending(request_id, {"prompt": PREFIX} if body is None else body))

    async def run() -> None:
        assert await router.choose_replicas([], pending("a", {"prompt": PREFIX})) == []
        assert await router.choose_replicas(REPLICAS, None) == [REPLICAS]
        odd: Any
        for odd in ({"prompt": []}, {"prompt": [-1]}, {"prompt": None}, {"messages": "hi"}, {"messages": [1]}):
            assert await choose("odd", odd) == [REPLICAS]
        # the same request id chosen again and again counts once
        for _ in range(3):
            ((first,), _rest) = await choose("a")
        assert router.router.stats().in_flight == 1
        router.on_request_completed(first.replica_id, "never-seen")  # unknown ids are ignored
        router.on_request_completed(replica("r9").replica_id, "a")  # a rejected attempt's notice, never routed
        other = next(r for r in REPLICAS if r is not first)
        router.on_request_routed(pending("a", {}), other.replica_id, None)  # Ray used another replica
        assert router.router.in_flight(other.replica_id.unique_id) == 1 and router.router.stats().in_flight == 1
        # routed again (Ray retried it) with no completion notice in between: the first routing stops counting
        await choose("a")
        router.on_request_routed(pending("a", {}), first.replica_id, None)
        assert router.router.stats().in_flight == 1
        router.on_request_completed(other.replica_id, "a")  # the earlier attempt's notice: ignored
        assert router.router.stats().in_flight == 1
        for _ in range(2):  # twice: idempotent
            router.on_request_completed(first.replica_id, "a")
        router.on_request_routed(pending("zzz", {}), first.replica_id, None)  # never chosen
        # a replica removed while a request is in flight there
        ((doomed,), _rest) = await choose("b")
        router.on_request_routed(pending("b", {}), doomed.replica_id, None)
        router.on_replica_actor_died(doomed.replica_id)
        router.on_request_completed(doomed.replica_id, "b")

    asyncio.run(run())
    assert router.errors == 0
    zero(router)
