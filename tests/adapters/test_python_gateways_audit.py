"""Found by an audit of the LiteLLM and Ray adapters as an independent client team: each test failed before its fix."""

from __future__ import annotations

import asyncio

from .test_ray import PREFIX, REPLICAS, FakeResult, bare, pending, zero


def test_a_rejected_attempts_late_notice_never_ends_a_retry_sent_to_the_same_replica() -> None:
    """Ray retries a rejected request at once, and the rejected attempt's completion notice comes from a worker
    thread, a moment later: the retry may have been sent to that same replica by then (its queue freed meanwhile).
    The late notice is the rejected attempt's; the retry counts until its own result is done."""
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
        assert router.router.in_flight(first.replica_id.unique_id) == 1
        result = FakeResult()
        router.on_request_routed(request, again.replica_id, result)
        assert router.router.in_flight(first.replica_id.unique_id) == 1
        router.on_request_completed(again.replica_id, "a")  # the accepted attempt's notice: its result decides
        assert router.router.stats().in_flight == 1
        result.done()

    asyncio.run(run())
    assert router.errors == 0 and not router._owed
    zero(router)
