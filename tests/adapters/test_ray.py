"""The Ray Serve request router on one local Ray: two deployments of three replicas each, routed by prefixroute (one
with ``bounded-load``, one with the defaults as a user deploys it: chat bodies of every shape, ``body=`` given by
keyword, a replica that dies with requests in flight), then its parts driven by hand."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import ray
from ray import serve
from ray.serve import context as serve_context
from ray.serve._private.common import ReplicaQueueLengthInfo
from ray.serve._private.request_router.common import RequestRoutingContext
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import RequestRouter
from tokenizers import Tokenizer

from prefixroute import BoundedLoad, Candidate, LoadPolicy, PredictedTTFT
from prefixroute.adapters.proxy.prompts import INLINE_TEXT
from prefixroute.adapters.ray import PrefixRouteRequestRouter, request_body
from prefixroute.adapters.serve.contract import salted
from prefixroute.errors import ConfigurationError, InvalidTypeError

from .conftest import CORPUS, LoopNoting, tool_call_conversation

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

    async def stream(self, body: dict[str, Any]) -> Any:
        """Yields ``n`` numbers, ``sleep`` seconds apart (``handle.options(stream=True, method_name="stream")``)."""
        for i in range(body.get("n", 3)):
            await asyncio.sleep(body.get("sleep", 0))
            yield i


@serve.deployment(
    num_replicas=3,
    ray_actor_options={"num_cpus": 0},
    request_router_config=RequestRouterConfig(
        request_router_class=cast(Any, "prefixroute.adapters.ray:PrefixRouteRequestRouter"),  # typed too narrowly
        request_router_kwargs={"block_size": 16},
    ),
)
class Engine:
    """As a user deploys it (the default policy): answers with its replica id after ``sleep`` seconds."""

    async def __call__(self, body: dict[str, Any]) -> str:
        await asyncio.sleep(body.get("sleep", 0))
        return str(serve.get_replica_context().replica_id.unique_id)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class FanOut:
    """Calls ``down`` ``n`` times at once, each with a prompt of its own (every call carries this replica's id)."""

    def __init__(self, down: Handle) -> None:
        self.down = down

    async def __call__(self, n: int) -> list[str]:
        calls = [self.down.remote({"prompt": list(range(10_000 * k, 10_000 * k + 64)), "sleep": 0.2}) for k in range(n)]
        return list(await asyncio.wait_for(asyncio.gather(*calls), timeout=30))


@pytest.fixture(scope="module")
def serving() -> Iterator[None]:
    """One local Ray and Serve for the module, both applications in it: starting Ray is most of the cost, and Ray
    started again in one process once failed to bring up its GCS in time. A start that fails part way is shut down
    too (ray.init may have started processes before it timed out)."""
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(proxy_location="Disabled")  # calls go through handles: no HTTP proxy actor to start
        yield
    finally:
        if ray.is_initialized():  # else serve.shutdown() would start a Ray of its own to look for Serve in
            serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


@pytest.fixture(scope="module")
def handle(serving: None) -> Handle:
    return serve.run(Replica.bind(), name="prefixroute-test", route_prefix=None)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def engine(serving: None) -> Handle:
    return serve.run(Engine.bind(), name="prefixroute-blackbox", route_prefix=None)  # type: ignore[attr-defined]


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
    # One after another, each once Ray has reported the one before complete (a moment after its result): until then
    # it still counts in flight, and with nothing cached elsewhere to lose, load may rightly send the next elsewhere.
    replicas, chats = set(), set()
    chat = [{"role": "system", "content": "You are terse. " * 20}]
    for i in range(5):
        replicas.add(handle.remote({"prompt": [*PREFIX, i]}).result())
        settled(handle)
    for i in range(3):
        chats.add(handle.remote({"messages": [*chat, {"role": "user", "content": str(i)}]}).result())
        settled(handle)
    assert len(replicas) == 1 and len(chats) == 1
    router = settled(handle)
    assert router.router.stats().commits >= 8


def test_a_multiplexed_call_routes_in_its_models_namespace(handle: Handle) -> None:
    multiplexed: Any = handle.options(multiplexed_model_id="lora")  # typed too narrowly
    used = multiplexed.remote({"prompt": [*PREFIX, 99]}).result()
    router = settled(handle)
    assert router.router.decide([*PREFIX, 99], [used], namespace="lora").matched_tokens > 0
    assert router.errors == 0


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


def test_streams_and_requests_the_caller_cancels_are_finished(handle: Handle) -> None:
    """Cancelled while queued for a replica (never routed, never completed), while running, or mid-stream."""
    streams: Any = handle.options(stream=True, method_name="stream")  # typed for unary calls
    assert list(streams.remote({"prompt": PREFIX, "n": 3})) == [0, 1, 2]
    settled(handle)
    generator = streams.remote({"prompt": PREFIX, "n": 100, "sleep": 0.05})
    assert next(iter(generator)) == 0
    generator.cancel()
    running: Any = handle.remote({"prompt": PREFIX, "sleep": 10})  # cancel() is untyped
    time.sleep(0.3)
    running.cancel()
    busy = [handle.remote({"prompt": [*PREFIX, i], "sleep": 1.5}) for i in range(3 * 32)]  # every slot taken
    time.sleep(0.5)
    queued: Any = handle.remote({"prompt": PREFIX, "sleep": 5})  # still running if a slow machine gave it a slot
    time.sleep(0.3)
    queued.cancel()
    for response in (running, queued):
        with pytest.raises(Exception, match="cancel"):
            response.result()
    assert all(response.result() for response in busy)
    router = settled(handle)
    assert not router._attempts and router.errors == 0


def test_concurrent_calls_a_replica_makes_downstream_are_each_answered(serving: None) -> None:
    # Was: Ray's base router finds the request a replica was chosen for by its internal id, in an index of one request
    # per id; calls a replica makes at once share its id, so the first was answered and the others routed for ever.
    fan_out = serve.run(FanOut.bind(Replica.bind()), name="prefixroute-fan-out", route_prefix=None)  # type: ignore[attr-defined]
    try:
        answers = fan_out.remote(4).result(timeout_s=60)
        assert len(answers) == 4 and all(isinstance(answer, str) for answer in answers)
    finally:
        serve.delete("prefixroute-fan-out")


def reject_first_reservation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first ``reserve_slot`` answers as a full replica does (not accepted), as when another router took its last
    slot between Ray's probe and the reservation; the replicas it was asked of are listed."""
    asked: list[str] = []
    reserve = RunningReplica.reserve_slot

    async def once_full(self: Any, request_metadata: Any) -> Any:
        asked.append(self.replica_id.unique_id)
        if len(asked) == 1:
            return "never-reserved", ReplicaQueueLengthInfo(accepted=False, num_ongoing_requests=0)
        return await reserve(self, request_metadata)

    monkeypatch.setattr(RunningReplica, "reserve_slot", once_full)
    return asked


def test_a_reservation_ray_retried_after_a_rejection_ends_with_its_dispatched_request(
    handle: Handle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: a rejected reserve_slot sends no completion notice, but the router took one to be owed to it, so the
    # dispatched request's own notice was swallowed and it counted in flight until its 600 s lease.
    handle.remote({"sleep": 0}).result()  # the handle has its request router once it has sent a request
    settled(handle)
    asked = reject_first_reservation(monkeypatch)
    body = {"prompt": [*PREFIX, 31]}

    async def reserve_and_dispatch() -> Any:
        async with handle.choose_replica(body) as selection:
            return await handle.dispatch(selection, body)

    assert asyncio.run(reserve_and_dispatch())
    assert len(asked) == 2 and asked[0] == asked[1]  # rejected, then reserved on the same replica
    assert settled(handle).errors == 0


def test_a_pick_only_selection_counts_nothing_once_made(handle: Handle) -> None:
    # Was: Ray asks a pick-only selection's ranking once and sends it nowhere it reports (no routing future, no
    # notice), so it counted in flight until its lease.
    handle.remote({"sleep": 0}).result()
    router = settled(handle)
    commits = router.router.stats().commits
    body = {"prompt": [*PREFIX, 32]}

    async def pick() -> str:
        async with handle.choose_replica(body, _reserve=False) as selection:
            return selection.replica_id

    picked = asyncio.run(pick())
    router = settled(handle)
    assert router.router.stats().commits == commits + 1  # committed where Ray's caller sends it
    assert router.router.decide(body["prompt"], [picked]).matched_tokens > 0
    assert router.errors == 0


def test_concurrent_calls_sharing_a_request_id_each_count(handle: Handle) -> None:
    # Was: the router kept one decision per request id until Ray reported it routed, so each call a replica makes
    # downstream at once (all carry its id) replaced the previous one's count, and only one was counted.
    handle.remote({"sleep": 0}).result()
    router = settled(handle)
    token = serve_context._serve_request_context.set(
        cast(Any, serve_context._RequestContext(_internal_request_id="shared"))  # typed as None only
    )
    try:
        calls = [handle.remote({"prompt": [*PREFIX, 40, i], "sleep": 1.5}) for i in range(6)]
    finally:
        serve_context._serve_request_context.reset(token)
    deadline = time.monotonic() + 5
    while router.router.stats().in_flight < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert router.router.stats().in_flight == 6
    assert all(call.result() for call in calls)
    assert settled(handle).errors == 0


def test_requests_without_a_prompt_are_ranked_by_ray_alone(handle: Handle) -> None:
    assert handle.remote({"sleep": 0}).result()  # the handle has its request router once it has sent a request
    decisions = request_router(handle).router.stats().decisions
    assert handle.remote({"sleep": 0}).result()
    assert request_router(handle).router.stats().decisions == decisions


# -- hostile calls, without a cluster: Ray's callbacks driven by hand ------------------------------------------------


class Exploding(LoadPolicy):
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        raise ValueError("policy bug")  # what a bad prompt raises too: still the policy's fault, and counted


def bare(**kwargs: Any) -> PrefixRouteRequestRouter:
    router = object.__new__(PrefixRouteRequestRouter)  # Ray's constructor wants a running deployment
    router._replicas, router._replicas_list, router._replica_id_set = {}, [], set()
    router._queue_len_gauge_last_update = {}
    router._multiplexed_model_id_to_replica_ids, router._multiplexed_model_id_fallback_match = defaultdict(set), set()
    router.initialize_state(**kwargs)
    return router


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


def replica(name: str) -> Any:
    return SimpleNamespace(replica_id=FakeReplicaID(name))


PENDING: dict[str, Any] = {}


def pending(request_id: str, body: Any) -> Any:
    made = SimpleNamespace(args=[body], kwargs={}, metadata=SimpleNamespace(internal_request_id=request_id))
    PENDING[request_id] = made
    return made


def asked_for(request_id: str) -> Any:
    """The request last made with ``request_id`` (Ray hands back the very PendingRequest it asked to rank)."""
    return PENDING.get(request_id) or pending(request_id, {})


REPLICAS = [replica(f"r{i}") for i in range(3)]


def zero(router: PrefixRouteRequestRouter) -> None:
    assert router.router.stats().in_flight == 0 and not router._started
    for candidate in router.router.decide([1] * 64, ["r0", "r1", "r2"]).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)


def test_chat_bodies_of_every_shape_and_a_body_by_keyword_route_on_their_prefix(engine: Handle) -> None:
    conversation = tool_call_conversation()
    engine.remote({"prompt": "warm up"}).result()
    router = settled(engine)
    commits = router.router.stats().commits
    places = set()
    for turn in range(4):
        body = {"messages": [*conversation, {"role": "user", "content": f"and then {turn}?"}]}
        reply = engine.remote(body=body) if turn % 2 else engine.remote(body)
        places.add(reply.result())
        settled(engine)
    assert len(places) == 1
    assert router.router.stats().commits == commits + 4
    assert router.errors == 0


def test_a_replica_that_dies_with_requests_in_flight_is_forgotten_and_counts_end(engine: Handle) -> None:
    body = {"prompt": list(range(5000, 5128))}
    home = engine.remote(body).result()
    router = settled(engine)
    assert home in router.router.index.backends()
    slow = [engine.remote({**body, "sleep": 30}) for _ in range(2)]
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
    router = settled(engine)
    deadline = time.monotonic() + 10  # Ray tells its router of the death on its own loop, a moment later
    while home in router.router.index.backends() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert home not in router.router.index.backends()
    assert engine.remote(body).result() != home
    settled(engine)
    assert router.errors == 0


def test_request_body_finds_the_openai_body_where_serve_calls_put_it() -> None:
    body = {"prompt": "hi"}
    find: Any = request_body  # fed Ray's PendingRequest's shape, not its class
    assert find(None) is None
    assert find(SimpleNamespace(args=[body, 2], kwargs={})) is body
    assert find(SimpleNamespace(args=[], kwargs={"body": body})) is body
    assert find(SimpleNamespace(args=(), kwargs={"messages": []})) == {"messages": []}
    assert find(SimpleNamespace(args=["hi"], kwargs={"body": {"text": "hi"}})) is None
    assert find(SimpleNamespace(args=["hi", body], kwargs={})) is None  # only the first positional is the body
    for junk in ("x", 3, SimpleNamespace(args="ab", kwargs={}), SimpleNamespace(args=[], kwargs=[])):
        with pytest.raises(InvalidTypeError, match=r"^request_body\(\) takes a Ray Serve PendingRequest"):
            find(junk)
    with pytest.raises(InvalidTypeError, match="or None, not int$"):
        find(3)


def test_bad_request_router_kwargs_raise_when_given() -> None:
    for lease in (0, -1, "600", float("inf")):
        with pytest.raises(ConfigurationError, match="lease"):
            bare(lease=lease)
    with pytest.raises(TypeError, match="^tokenizer must be a path .* not int$"):
        bare(tokenizer=5)
    with pytest.raises(ConfigurationError, match="policy"):
        bare(policy="no-such-policy")
    assert bare(lease=None)._lease is None


def test_request_router_kwargs_reach_the_router_as_documented(model_dir: Path) -> None:
    router = bare()
    assert router._lease == 600.0 and router.router.block_size == 16
    assert isinstance(router.router.policy, PredictedTTFT)
    router = bare(policy="bounded-load", factor=1.5, block_size=32, lease=30)
    assert isinstance(router.router.policy, BoundedLoad) and router.router.policy.factor == 1.5
    assert (router.router.block_size, router._lease) == (32, 30)
    router = bare(policy="prefix-affinity", tokenizer=str(model_dir))
    text = " ".join(CORPUS[:4])
    ((chosen,), _rest) = asyncio.run(router.choose_replicas(REPLICAS, pending("a", {"prompt": text})))
    decision = next(iter(router._attempts.values())).decision
    assert decision.prompt_tokens == len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)
    router.on_request_routed(asked_for("a"), chosen.replica_id, None)
    router.on_request_completed(chosen.replica_id, "a")
    zero(router)


def test_a_policy_that_raises_keeps_rays_ranking() -> None:
    router = bare(policy=f"{__name__}:Exploding")
    ranks = asyncio.run(router.choose_replicas(REPLICAS, pending("a", {"prompt": PREFIX})))
    assert ranks == [REPLICAS] and router.errors == 1
    assert router.router.stats().in_flight == 0 and not router._attempts


class Refusing:
    """A future or result whose ``add_done_callback`` raises (garbage Ray never sends)."""

    def add_done_callback(self, callback: Any) -> None:
        raise RuntimeError("no callbacks here")


def test_a_callback_that_cannot_be_registered_leaves_nothing_counted() -> None:
    router = bare(policy="bounded-load")
    request = pending("a", {"prompt": PREFIX})
    request.future = Refusing()
    assert asyncio.run(router.choose_replicas(REPLICAS, request)) == [REPLICAS] and router.errors == 1
    assert not router._attempts
    zero(router)
    asyncio.run(router.choose_replicas(REPLICAS, pending("b", {"prompt": PREFIX})))
    router.on_request_routed(asked_for("b"), replica("r1").replica_id, Refusing())
    assert router.errors == 2
    zero(router)


def test_hostile_callbacks_leave_every_count_at_zero() -> None:
    PENDING.clear()
    router = bare(policy="bounded-load")

    async def choose(request_id: str, body: Any = None, replicas: Any = REPLICAS) -> Any:
        request = PENDING.get(request_id) if body is None else None  # Ray asks again with the same request
        request = request or pending(request_id, {"prompt": PREFIX} if body is None else body)
        return await router.choose_replicas(replicas, request)

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
        router.on_request_routed(asked_for("a"), other.replica_id, None)  # Ray used another replica
        assert router.router.in_flight(other.replica_id.unique_id) == 1 and router.router.stats().in_flight == 1
        # routed again (Ray retried it) with no completion notice in between: the first routing stops counting
        await choose("a")
        router.on_request_routed(asked_for("a"), first.replica_id, None)
        assert router.router.stats().in_flight == 1
        router.on_request_completed(other.replica_id, "a")  # the earlier attempt's notice: ignored
        assert router.router.stats().in_flight == 1
        for _ in range(2):  # twice: idempotent
            router.on_request_completed(first.replica_id, "a")
        router.on_request_routed(asked_for("zzz"), first.replica_id, None)  # never chosen
        # a replica removed while a request is in flight there
        ((doomed,), _rest) = await choose("b")
        router.on_request_routed(asked_for("b"), doomed.replica_id, None)
        router.on_replica_actor_died(doomed.replica_id)
        router.on_request_completed(doomed.replica_id, "b")

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


class FakeResult:
    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def done(self) -> None:
        for callback in self.callbacks:
            callback(self)


def test_requests_sharing_an_id_each_count_until_their_own_result_is_done() -> None:
    """Every call a replica makes downstream carries that replica's request id; rejected attempts notify too."""
    router = bare(policy="bounded-load")

    async def run() -> None:
        results = []
        for replica_used in REPLICAS[:2] * 2:  # four requests, one id, two on each replica
            await router.choose_replicas(REPLICAS, pending("shared", {"prompt": PREFIX}))
            result = FakeResult()
            router.on_request_routed(asked_for("shared"), replica_used.replica_id, result)
            results.append(result)
        assert router.router.stats().in_flight == 4
        for replica_used in REPLICAS:  # notices, of rejected attempts or not, change nothing: the results decide
            router.on_request_completed(replica_used.replica_id, "shared")
        assert router.router.stats().in_flight == 4
        for left, result in zip((3, 2, 1, 0), results, strict=True):
            result.done()
            assert router.router.stats().in_flight == left

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_a_request_cancelled_before_it_is_routed_stops_counting() -> None:
    router = bare(policy="bounded-load")

    async def run() -> None:
        request = pending("a", {"prompt": PREFIX})
        request.future = asyncio.get_running_loop().create_future()
        for _ in range(3):  # Ray chooses again and again while every replica is busy
            await router.choose_replicas(REPLICAS, request)
        assert router.router.stats().in_flight == 1
        request.future.cancel()
        await asyncio.sleep(0)
        assert router.router.stats().in_flight == 0 and not router._attempts
        routed = pending("b", {"prompt": PREFIX})  # a future that is fulfilled changes nothing
        routed.future = asyncio.get_running_loop().create_future()
        ((chosen,), _rest) = await router.choose_replicas(REPLICAS, routed)
        routed.future.set_result(chosen)
        await asyncio.sleep(0)
        router.on_request_routed(routed, chosen.replica_id, None)
        router.on_request_completed(chosen.replica_id, "b")

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_a_request_sent_without_on_request_routed_is_finished_by_its_completion_notice() -> None:
    """Ray sends some requests without its rejection protocol, so no ``on_request_routed`` comes: a Ray Client
    driver's handle and Java replicas (``with_rejection=False``), ``handle._choose_replica`` then ``_dispatch``.
    The routing future names the replica; that replica's one completion notice ends the request."""
    router = bare(policy="bounded-load")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        request = pending("a", {"prompt": PREFIX})
        request.future = loop.create_future()
        ((chosen,), rest) = await router.choose_replicas(REPLICAS, request)
        used = rest[0]  # Ray took the second ranked (the first one's queue was full)
        request.future.set_result(used)
        await asyncio.sleep(0)
        assert router.router.in_flight(used.replica_id.unique_id) == 1 and router.router.stats().in_flight == 1
        router.on_request_completed(chosen.replica_id, "a")  # not the replica it went to: ignored
        assert router.router.stats().in_flight == 1
        router.on_request_completed(used.replica_id, "a")
        assert router.router.stats().in_flight == 0 and not router._attempts
        # with the rejection protocol: a rejected attempt's late notice never ends the retry
        retried = pending("b", {"prompt": PREFIX})
        retried.future = loop.create_future()
        ((first,), _rest) = await router.choose_replicas(REPLICAS, retried)
        retried.future.set_result(first)
        await asyncio.sleep(0)
        retried.future = loop.create_future()  # Ray's reset_future() before it chooses again
        ((again,), _rest) = await router.choose_replicas(REPLICAS, retried)
        router.on_request_completed(first.replica_id, "b")  # the rejected attempt's notice, late
        assert router.router.stats().in_flight == 1
        retried.future.set_result(again)
        await asyncio.sleep(0)
        result = FakeResult()
        router.on_request_routed(retried, again.replica_id, result)
        router.on_request_completed(again.replica_id, "b")  # the result decides, not the notice
        assert router.router.stats().in_flight == 1
        result.done()
        # a rejected attempt's notice that comes once its retry went to the same replica ends the retry's count until
        # Ray reports the retry routed; then it counts again, until its own result is done
        late = pending("c", {"prompt": PREFIX})
        late.future = loop.create_future()
        ((first,), _rest) = await router.choose_replicas(REPLICAS, late)
        late.future.set_result(first)
        await asyncio.sleep(0)
        late.future = loop.create_future()
        await router.choose_replicas(REPLICAS, late)
        late.future.set_result(first)
        await asyncio.sleep(0)
        assert router.router.in_flight(first.replica_id.unique_id) == 1
        router.on_request_completed(first.replica_id, "c")  # the rejected attempt's, late
        assert router.router.stats().in_flight == 0
        result = FakeResult()
        router.on_request_routed(late, first.replica_id, result)
        assert router.router.in_flight(first.replica_id.unique_id) == 1
        result.done()

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_replicas_ray_stops_listing_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that leaves the set Ray routes to (scaled down, replaced) takes its blocks and requests with it,
    as a dead one does: with autoscaling, each new replica has a new id, so nothing else would ever free them."""
    listed: list[Any] = []
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: listed.append(replicas))
    router = bare(policy="bounded-load")

    async def run() -> None:
        router.update_replicas(REPLICAS)
        for i, used in enumerate(REPLICAS):
            await router.choose_replicas(REPLICAS, pending(str(i), {"prompt": [*PREFIX, i]}))
            router.on_request_routed(asked_for(str(i)), used.replica_id, None)
        router.update_replicas(REPLICAS[:2])  # r2 scaled down while its request runs
        assert listed == [REPLICAS, REPLICAS[:2]]  # Ray's own bookkeeping ran
        assert "r2" not in router.router.index.backends() and router.router.in_flight("r2") == 0
        assert {"r0", "r1"} <= set(router.router.index.backends())
        for i, used in enumerate(REPLICAS):
            router.on_request_completed(used.replica_id, str(i))
        router.update_replicas([])  # garbage or not, never raises
        router.update_replicas(cast(Any, [None]))

    asyncio.run(run())
    assert router.errors == 1
    zero(router)


def test_a_multiplexed_model_routes_among_its_replicas_in_a_namespace_of_its_own() -> None:
    """``handle.options(multiplexed_model_id=...)``: as Ray's own router does, the replicas that hold the model are
    ranked, not the others; and the model's prefixes are its own (a LoRA adapter's KV is not the base model's)."""
    router = bare(policy="bounded-load")
    router._multiplexed_model_id_to_replica_ids["lora"] = {REPLICAS[1].replica_id}
    router._replica_id_set = {r.replica_id for r in REPLICAS}

    def request(request_id: str, model: str, body: Any) -> Any:
        made = pending(request_id, body)
        made.metadata.multiplexed_model_id = model
        made.routing_context = RequestRoutingContext()
        return made

    async def run() -> None:
        first = request("a", "", {"prompt": PREFIX})
        ((base,), _rest) = await router.choose_replicas(REPLICAS, first)
        router.on_request_routed(first, base.replica_id, None)
        router.on_request_completed(base.replica_id, "a")
        if base is REPLICAS[1]:  # the base model's prefix on the lora replica: it must not count as the lora's
            assert router.router.decide(PREFIX, ["r1"], namespace="lora").matched_tokens == 0
        for i in range(3):
            lora = request(f"m{i}", "lora", {"prompt": PREFIX})
            ranks = await router.choose_replicas(REPLICAS, lora)
            assert ranks[0] == [REPLICAS[1]] and all(r is REPLICAS[1] for rank in ranks for r in rank)
            router.on_request_routed(lora, REPLICAS[1].replica_id, None)
            router.on_request_completed(REPLICAS[1].replica_id, f"m{i}")
        assert router.router.decide(PREFIX, ["r1"], namespace="lora").matched_tokens > 0
        # no replica of the deployment's list holds it yet: none of those is ranked, Ray asks again
        assert await router.choose_replicas([REPLICAS[0]], request("n", "lora", {"prompt": PREFIX})) == []
        # a multiplexed request without a prompt still goes to the model's replicas
        assert await router.choose_replicas(REPLICAS, request("p", "lora", {})) == [[REPLICAS[1]]]

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_a_salted_request_routes_apart_as_vllm_caches_it() -> None:
    """vLLM hashes a request's ``cache_salt`` into its first block: a salted prompt's blocks are hit only by the
    same salt's requests (a tenant's), never by unsalted ones; the router ranked them all in one namespace."""
    router = bare()
    everywhere = [r.replica_id.unique_id for r in REPLICAS]

    def matched(namespace: str | None) -> int:
        return router.router.decide(PREFIX, everywhere, namespace=namespace).matched_tokens

    async def send(request_id: str, body: dict[str, Any]) -> None:
        ((chosen, *_), *_) = await router.choose_replicas(REPLICAS, pending(request_id, body))
        router.on_request_routed(asked_for(request_id), chosen.replica_id, None)
        router.on_request_completed(chosen.replica_id, request_id)

    asyncio.run(send("a", {"prompt": PREFIX, "cache_salt": "tenant-a"}))
    assert matched(salted(None, "tenant-a")) > 0 and matched(None) == 0  # its blocks are the salt's alone
    asyncio.run(send("b", {"prompt": PREFIX}))
    assert matched(None) > 0 and matched(salted(None, "tenant-b")) == 0
    zero(router)


def test_a_long_prompt_is_encoded_off_the_event_loop() -> None:
    """Tokenizing a long prompt on the loop of Ray's router would hold up every other request's routing."""
    router = bare(policy="prefix-affinity")
    router._encoder = encoder = LoopNoting()
    long = "x" * INLINE_TEXT

    async def send(request_id: str, prompt: str) -> Any:
        request = pending(request_id, {"prompt": prompt})
        ((chosen,), _rest) = await router.choose_replicas(REPLICAS, request)
        router.on_request_routed(request, chosen.replica_id, None)
        router.on_request_completed(chosen.replica_id, request_id)
        return chosen

    async def run() -> None:
        assert await send("a", long + "a") is await send("b", long + "b")
        await send("c", "short")

    asyncio.run(run())
    assert encoder.on_loop == [False, False, True] and router.errors == 0
    zero(router)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_way_a_request_counts_ends_with_its_lease() -> None:
    """A request Ray never reports complete stops counting after ``lease`` seconds, wherever the count stands: as
    chosen, moved by its routing future to the replica Ray sent it to, or committed by ``on_request_routed``."""
    clock = Clock()
    router = bare(policy="bounded-load", lease=5.0, clock=clock)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        await router.choose_replicas(REPLICAS, pending("chosen", {"prompt": PREFIX}))
        moved = pending("moved", {"prompt": [*PREFIX, 1]})
        moved.future = loop.create_future()
        ((_first,), rest) = await router.choose_replicas(REPLICAS, moved)
        moved.future.set_result(rest[0])
        await asyncio.sleep(0)
        assert router.router.in_flight(rest[0].replica_id.unique_id) >= 1
        ((first,), rest) = await router.choose_replicas(REPLICAS, pending("routed", {"prompt": [*PREFIX, 2]}))
        router.on_request_routed(asked_for("routed"), rest[0].replica_id, FakeResult())  # never done
        assert router.router.stats().in_flight == 3
        clock.now = 4.9
        assert router.router.stats().in_flight == 3
        clock.now = 5.1
        stats = router.router.stats()
        assert (stats.in_flight, stats.leases_expired) == (0, 3)

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_requests_ray_abandons_before_routing_are_dropped_oldest_first_past_the_bound() -> None:
    router = bare(policy="bounded-load")
    router._max_pending = 3

    async def run() -> None:
        for i in range(5):  # chosen, never routed, no future: only the bound ends them
            await router.choose_replicas(REPLICAS, pending(str(i), {"prompt": [*PREFIX, i]}))
            assert router.router.stats().in_flight == min(i + 1, 3)
        for dropped in ("0", "1"):  # their late notices find nothing
            router.on_request_routed(asked_for(dropped), REPLICAS[0].replica_id, None)
        assert router.router.stats().in_flight == 3
        for kept in ("2", "3", "4"):
            router.on_request_routed(asked_for(kept), REPLICAS[0].replica_id, None)
            router.on_request_completed(REPLICAS[0].replica_id, kept)

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_a_routing_future_moves_the_count_only_to_a_replica_of_that_attempt() -> None:
    """The future of each attempt names the replica Ray sends it to: the count moves there, once, and on_request_routed
    then counts it there without committing twice; a future naming a replica that was no candidate, a result that
    names none, or an earlier attempt's future moves nothing and is no error."""
    router = bare(policy="bounded-load")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        request = pending("a", {"prompt": PREFIX})
        request.future = loop.create_future()
        ((chosen,), rest) = await router.choose_replicas(REPLICAS, request)
        request.future.set_result(rest[0])
        await asyncio.sleep(0)
        used = rest[0].replica_id.unique_id
        assert router.router.in_flight(used) == 1 and router.router.stats().in_flight == 1
        result = FakeResult()
        router.on_request_routed(request, rest[0].replica_id, result)
        assert router.router.in_flight(used) == 1 and router.router.stats().in_flight == 1
        assert router.router.stats().commits == 1
        result.done()
        assert router.router.stats().in_flight == 0

        for name, answer in (("stranger", replica("r9")), ("anonymous", object())):
            request = pending(name, {"prompt": PREFIX})
            request.future = loop.create_future()
            ((chosen,), _rest) = await router.choose_replicas(REPLICAS, request)
            request.future.set_result(answer)
            await asyncio.sleep(0)
            assert router.router.in_flight(chosen.replica_id.unique_id) == 1
            assert router.router.stats().in_flight == 1
            router.on_request_completed(cast(Any, answer).replica_id if name == "stranger" else chosen.replica_id, name)
            if name == "anonymous":  # no replica named: only Ray's routing of it ends it
                router.on_request_routed(request, chosen.replica_id, None)
                router.on_request_completed(chosen.replica_id, name)
            assert router.router.stats().in_flight == 0

        stale = pending("b", {"prompt": PREFIX})
        stale.future = loop.create_future()
        ((first,), rest) = await router.choose_replicas(REPLICAS, stale)
        earlier = stale.future
        stale.future = loop.create_future()  # Ray's reset_future() before it chooses again
        ((again,), _rest) = await router.choose_replicas(REPLICAS, stale)
        other = next(r for r in REPLICAS if r is not again)
        earlier.set_result(other)  # the earlier attempt's, late
        await asyncio.sleep(0)
        assert router.router.in_flight(other.replica_id.unique_id) == 0
        stale.future.cancel()  # the new attempt's own future ends it
        await asyncio.sleep(0)
        assert router.router.stats().in_flight == 0

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_chat_messages_route_on_their_rendered_prefix() -> None:
    router = bare(policy="prefix-affinity")
    system = {"role": "system", "content": "You are a careful assistant. " * 40}

    async def send(request_id: str, question: str) -> Any:
        body = {"messages": [system, {"role": "user", "content": question}]}
        ranks = await router.choose_replicas(REPLICAS, pending(request_id, body))
        assert ranks != [REPLICAS]  # ranked by prefixroute, not left in Ray's order
        ((chosen,), _rest) = ranks
        router.on_request_routed(asked_for(request_id), chosen.replica_id, None)
        router.on_request_completed(chosen.replica_id, request_id)
        return chosen.replica_id.unique_id

    async def run() -> None:
        homes = {await send(str(i), f"question {i}?") for i in range(4)}
        assert len(homes) == 1 and router.router.stats().decisions == 4

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


class Unreadable:
    """A routing future whose state cannot be read (garbage Ray never sends)."""

    def add_done_callback(self, callback: Any) -> None:
        callback(self)

    def cancelled(self) -> bool:
        raise RuntimeError("unreadable")


def follow_unreadable_future(router: PrefixRouteRequestRouter, i: int) -> None:
    request = pending(str(i), {"prompt": PREFIX})
    request.future = Unreadable()
    asyncio.run(router.choose_replicas(REPLICAS, request))
    router.on_request_routed(request, REPLICAS[0].replica_id, None)
    router.on_request_completed(REPLICAS[0].replica_id, str(i))


FAILING_CALLBACKS: dict[str, Callable[[PrefixRouteRequestRouter, int], None]] = {
    "a routing future": follow_unreadable_future,
    "a completion notice": lambda router, i: router.on_request_completed(REPLICAS[0].replica_id, cast(Any, [i])),
    "a dead replica": lambda router, i: router.on_replica_actor_died(cast(Any, FakeReplicaID)(None)),
    "Ray's replicas": lambda router, i: router.update_replicas(cast(Any, [None])),
}


def test_every_callback_counts_each_of_its_failures_and_keeps_ray_going(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)  # Ray's own reads replica ids
    router = bare(policy=f"{__name__}:Exploding")
    for _ in range(2):
        assert asyncio.run(router.choose_replicas(REPLICAS, pending("a", {"prompt": PREFIX}))) == [REPLICAS]
    assert router.errors == 2
    for name, call in FAILING_CALLBACKS.items():
        router = bare(policy="bounded-load")
        for i in range(2):
            call(router, i)
        assert router.errors == 2, name
        zero(router)


def test_a_dead_replica_takes_only_its_own_requests_and_rays_bookkeeping_runs() -> None:
    router = bare(policy="bounded-load")
    router._replica_id_set = {r.replica_id for r in REPLICAS}

    async def run() -> None:
        for i, used in enumerate(REPLICAS):
            await router.choose_replicas(REPLICAS, pending(str(i), {"prompt": [*PREFIX, i]}))
            router.on_request_routed(asked_for(str(i)), used.replica_id, None)
        router.on_replica_actor_died(REPLICAS[0].replica_id)
        assert REPLICAS[0].replica_id not in router._replica_id_set  # Ray's own bookkeeping ran
        assert router.router.stats().in_flight == 2
        for i, used in enumerate(REPLICAS):
            router.on_request_completed(used.replica_id, str(i))

    asyncio.run(run())
    assert router.errors == 0
    zero(router)


def test_a_request_ray_sends_to_a_replica_that_was_no_candidate_stops_counting() -> None:
    router = bare(policy="bounded-load")
    asyncio.run(router.choose_replicas(REPLICAS, pending("a", {"prompt": PREFIX})))
    router.on_request_routed(asked_for("a"), replica("r9").replica_id, FakeResult())
    assert router.errors == 0
    zero(router)
