"""Found by an audit of the LiteLLM and Ray adapters as an independent client team: each test failed before its fix."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported: no network

import asyncio  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.integrations.custom_logger import CustomLogger  # noqa: E402
from litellm.router import Router as LiteLLMRouter  # noqa: E402

from prefixroute import Router  # noqa: E402
from prefixroute.adapters.litellm import PrefixRouteHook  # noqa: E402
from prefixroute.testing.openai_engine import OpenAIEngine  # noqa: E402

from ..conftest import running_engines
from .test_litellm import ask, model_list, settled
from .test_ray import PREFIX, REPLICAS, FakeResult, bare, pending, zero


def test_a_rejected_attempts_late_notice_pauses_a_retry_sent_to_the_same_replica_until_it_is_routed() -> None:
    """Ray retries a rejected request at once, and the rejected attempt's completion notice comes from a worker
    thread, a moment later: the retry may have been sent to that same replica by then (its queue freed meanwhile).
    Ray's notice names no attempt, and a rejected reservation sends none, so it is owed by none: it ends the retry's
    count until Ray reports the retry routed, which counts it again, until its own result is done."""
    router = bare(policy="bounded-load")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        request = pending("a", {"prompt": PREFIX})
        request.future = loop.create_future()
        ((first,), _rest) = await router.choose_replicas(REPLICAS, request)
        request.future.set_result(first)  # sent there, and rejected
        await asyncio.sleep(0)
        request.future = loop.create_future()  # Ray's reset_future() before it chooses again
        ranked = await router.choose_replicas(REPLICAS, request)
        again = first  # Ray tries the ranked replicas in turn: the one that rejected has room again
        assert any(again in replicas for replicas in ranked)
        request.future.set_result(again)
        await asyncio.sleep(0)
        router.on_request_completed(first.replica_id, "a")  # the rejected attempt's notice, late
        assert router.router.in_flight(first.replica_id.unique_id) == 0
        result = FakeResult()
        router.on_request_routed(request, again.replica_id, result)
        assert router.router.in_flight(first.replica_id.unique_id) == 1
        router.on_request_completed(again.replica_id, "a")  # the accepted attempt's notice: its result decides
        assert router.router.stats().in_flight == 1
        result.done()

    asyncio.run(run())
    assert router.errors == 0 and not router._attempts
    zero(router)


def test_two_rejected_attempts_late_notices_on_one_replica_leave_the_retry_counted_once_routed() -> None:
    """Two rejections on one replica, then a retry sent there; both late notices come after the retry was sent,
    before Ray reports it accepted: the first ends the retry's count, the second finds nothing, and the retry counts
    from Ray's report that it was routed until its result is done."""
    router = bare(policy="bounded-load")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        request = pending("a", {"prompt": PREFIX})
        request.future = loop.create_future()
        ((first,), _rest) = await router.choose_replicas(REPLICAS, request)
        for _ in range(2):  # sent to `first` and rejected, twice
            request.future.set_result(first)
            await asyncio.sleep(0)
            request.future = loop.create_future()
            await router.choose_replicas(REPLICAS, request)
        request.future.set_result(first)  # the retry, sent there
        await asyncio.sleep(0)
        for _ in range(2):
            router.on_request_completed(first.replica_id, "a")  # the two rejected attempts' notices, late
            assert router.router.in_flight(first.replica_id.unique_id) == 0
        result = FakeResult()
        router.on_request_routed(request, first.replica_id, result)  # the retry accepted
        assert router.router.in_flight(first.replica_id.unique_id) == 1
        router.on_request_completed(first.replica_id, "a")  # the retry's own notice: its result decides
        result.done()

    asyncio.run(run())
    assert router.errors == 0 and not router._attempts
    zero(router)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(3, max_tokens=3)


class Emptying(CustomLogger):
    """A deployment filter that runs after prefixroute's and, when told to, leaves nothing: as LiteLLM's budget limiter
    does to a deployment over its budget (LiteLLM's rpm / tpm limits fail a call after the filters the same way)."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = False

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list[Any],
        messages: list[Any] | None,
        request_kwargs: dict[str, Any] | None = None,
        parent_otel_span: Any = None,
    ) -> list[Any]:
        return [] if self.empty else healthy_deployments


def test_a_call_litellm_never_sent_stops_counting_at_its_tasks_next_call_and_leaves_no_prediction(
    engines: list[OpenAIEngine],
) -> None:
    """LiteLLM sends nothing and calls no callback when it fails a call after the filters chose (no deployment left,
    every one over its rpm): the next routing in the same task ends that decision (every count back to 0), refused,
    as it reached no engine, so the blocks its commit predicted are forgotten and the index holds what it would hold
    had the call never been made."""

    def blocks_after(fail_first: bool) -> int:
        hook = PrefixRouteHook(Router())
        emptying = Emptying()
        for callback in (hook, emptying):
            litellm.logging_callback_manager.add_litellm_callback(callback)
        router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)

        async def run() -> None:
            if fail_first:
                emptying.empty = True
                with pytest.raises(ValueError, match="No deployments available"):
                    await router.acompletion(model="fake", messages=[{"role": "user", "content": "never sent " * 40}])
                emptying.empty = False
            await router.acompletion(model="fake", messages=[{"role": "user", "content": "answered " * 40}])
            await settled(hook)

        try:
            asyncio.run(run())
        finally:
            for callback in (hook, emptying):
                litellm.logging_callback_manager.remove_callback_from_all_lists(callback)
        assert hook.errors == 0
        return sum(hook.router.index.blocks(f"gpu{i}") for i in range(3))

    assert blocks_after(fail_first=True) == blocks_after(fail_first=False) > 0


def test_registered_after_litellms_router_the_hook_picks_among_the_deployments_its_budget_leaves(
    engines: list[OpenAIEngine],
) -> None:
    """LiteLLM runs deployment filters in the order they were registered, and its Router registers its budget
    limiter as it is built: the hook registered after it (as docs/adapters.md says) picks among the deployments
    still within budget, so a prompt that prefers a spent deployment is served by another one."""
    spent = [
        {"model_name": "fake", "model_info": {"id": f"spent{i}"},
         "litellm_params": {**deployment["litellm_params"], "max_budget": 1e-9, "budget_duration": "1d",
                            "input_cost_per_token": 1.0, "output_cost_per_token": 1.0}}
        for i, deployment in enumerate(model_list(engines))
    ]  # fmt: skip
    hook = PrefixRouteHook(Router())
    routers: list[LiteLLMRouter] = []

    async def run() -> list[str]:
        router = LiteLLMRouter(model_list=spent, num_retries=0)  # its budget limiter starts a task on this loop
        routers.append(router)
        litellm.logging_callback_manager.add_litellm_callback(hook)
        served = []
        for _ in range(3):  # the same prompt: without budgets, all three would go to one deployment
            served.append((await ask(router, "the same question"))._hidden_params["model_id"])
            await settled(hook)  # LiteLLM books the spend in its success callback
        with pytest.raises(ValueError, match="No deployments available"):
            await ask(router, "the same question")
        return served

    try:
        served = asyncio.run(run())
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(hook)
        for router in routers:
            router.retire()  # its budget limiter is a process-wide callback: later tests must not meet it
    assert sorted(served) == ["spent0", "spent1", "spent2"]
    assert hook.errors == 0
