"""The documented rules of the LiteLLM hook that its other tests leave open (found by mutation testing of
``prefixroute/adapters/litellm.py``): the hook is driven by hand, as LiteLLM calls it, with no engine."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: LiteLLM's bundled price map

import asyncio  # noqa: E402
from collections.abc import Iterator, Mapping  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from prefixroute import Router  # noqa: E402
from prefixroute.adapters.litellm import PrefixRouteHook  # noqa: E402
from prefixroute.adapters.serve.contract import salted

from ..conftest import FakeClock
from .test_litellm import CHAT, _chunks, group

IDS = ["gpu0", "gpu1", "gpu2"]


def chosen(
    hook: PrefixRouteHook, request: dict[str, Any], messages: list[Any] = CHAT, deployments: list[Any] | None = None
) -> str:
    """The one deployment the hook's filter keeps among ``deployments`` (default :func:`group`'s three) for
    ``request`` (LiteLLM's ``request_kwargs``)."""
    given = group() if deployments is None else deployments
    (kept,) = asyncio.run(hook.async_filter_deployments("fake", given, messages, request))
    return str(kept["model_info"]["id"])


def ordered(*orders: object) -> list[dict[str, Any]]:
    """:func:`group`'s deployments, each with the ``litellm_params.order`` given for it."""
    deployments = group(len(orders))
    for deployment, order in zip(deployments, orders, strict=True):
        deployment["litellm_params"] = {"model": "hosted_vllm/fake-model", "order": order}
    return deployments


def places(hook: PrefixRouteHook, deployments: list[Any], **request: Any) -> set[str]:
    """Where 24 different prompts go (each finished by its success callback before the next)."""
    where = set()
    for prompt in range(24):
        metadata: dict[str, Any] = {}
        messages = [{"role": "system", "content": f"{prompt} " * 40}, {"role": "user", "content": "x"}]
        where.add(chosen(hook, {"metadata": metadata, **request}, messages, deployments))
        asyncio.run(hook.async_log_success_event({"litellm_params": {"metadata": metadata}}, None, None, None))
    assert hook.router.stats().in_flight == 0
    return where


@pytest.mark.parametrize("where", ["call", "extra_body"])
def test_a_salted_call_routes_apart_as_vllm_caches_it(where: str) -> None:
    """vLLM hashes a request's ``cache_salt`` into its first block: a salted call's blocks are hit only by the same
    salt's calls. LiteLLM passes it as the call's own argument or in ``extra_body``; both routed unsalted before."""
    hook = PrefixRouteHook(Router(), base_groups=["fake"])
    prompt = [{"role": "user", "content": "a long shared question " * 20}]

    def call(salt: str | None) -> None:
        metadata: dict[str, Any] = {}
        request: dict[str, Any] = {"metadata": metadata}
        if salt is not None:
            request.update({"cache_salt": salt} if where == "call" else {"extra_body": {"cache_salt": salt}})
        chosen(hook, request, prompt)
        asyncio.run(hook.async_log_success_event({"litellm_params": {"metadata": metadata}}, None, None, None))

    def matched(namespace: str | None) -> int:
        tokens = hook._encoder.encode_chat(prompt)
        return hook.router.decide(tokens, IDS, namespace=namespace).matched_tokens

    call("tenant-a")
    assert matched(salted(None, "tenant-a")) > 0 and matched(None) == 0
    call(None)
    assert matched(None) > 0 and matched(salted(None, "tenant-b")) == 0


def test_bad_options_raise_a_type_error_that_names_the_option() -> None:
    with pytest.raises(TypeError, match=r"^router must be a prefixroute\.Router, not object$"):
        PrefixRouteHook(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^model_groups must be a collection of model group names, not int$"):
        PrefixRouteHook(Router(), model_groups=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^model_groups must be a collection of model group names, not str$"):
        PrefixRouteHook(Router(), model_groups="llama")
    with pytest.raises(TypeError, match=r"^base_groups must be a collection of model group names, not bytes$"):
        PrefixRouteHook(Router(), base_groups=b"llama")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^base_groups must hold model group names \(str\), not int \(1\)$"):
        PrefixRouteHook(Router(), base_groups=["llama", 1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"^model_groups must hold model group names \(str\), not NoneType"):
        PrefixRouteHook(Router(), model_groups=[None])  # type: ignore[list-item]


@pytest.mark.parametrize("lease", [None, 30.0])
def test_a_call_whose_callbacks_never_come_stops_counting_after_its_lease(lease: float | None) -> None:
    """``lease``: seconds after which a request whose callbacks never came stops counting (default 600)."""
    clock = FakeClock()
    hook = PrefixRouteHook(Router(clock=clock)) if lease is None else PrefixRouteHook(Router(clock=clock), lease=lease)
    expires = 600.0 if lease is None else lease
    chosen(hook, {"metadata": {}})
    clock.tick(expires - 0.5)
    assert hook.router.stats().in_flight == 1
    clock.tick(1.0)
    assert hook.router.stats().in_flight == 0 and hook.router.stats().leases_expired == 1


def test_no_lease_counts_a_call_until_its_callback() -> None:
    clock = FakeClock()
    hook = PrefixRouteHook(Router(clock=clock), lease=None)
    metadata: dict[str, Any] = {}
    chosen(hook, {"metadata": metadata})
    clock.tick(1e6)
    assert hook.router.stats().in_flight == 1
    asyncio.run(hook.async_log_success_event({"litellm_params": {"metadata": metadata}}, None, None, None))
    assert hook.router.stats().in_flight == 0 and hook.router.stats().leases_expired == 0


def test_the_filter_chooses_among_the_order_litellm_picks_after_it() -> None:
    """The lowest ``order`` given, or the request's ``_target_order`` (LiteLLM's fallback to the next order); all of
    the deployments when none has that order."""
    hook = PrefixRouteHook(Router())
    assert places(hook, ordered(1, 1, 2)) == {"gpu0", "gpu1"}
    assert places(hook, ordered(2, 3, 2)) == {"gpu0", "gpu2"}
    assert places(hook, ordered(1, 1, 2), _target_order=2) == {"gpu2"}
    assert places(hook, ordered(1, 2, 2), _target_order=2) == {"gpu1", "gpu2"}
    assert places(hook, ordered(1, 1, 2), _target_order=3) == set(IDS)
    assert places(hook, ordered(None, 2, 2)) == {"gpu1", "gpu2"}  # a deployment without an order is no lower


def test_the_filter_reads_an_order_as_litellm_does() -> None:
    """LiteLLM reads a deployment's order from ``litellm_params.order``, else ``model_info.order`` (models added
    through its API keep it there), and takes ``1``, ``1.0``, ``"1"`` and ``True`` for order 1: a filter that missed
    one of them would keep an order-2 backup beside healthy order-1 deployments, and LiteLLM would send it there."""
    hook = PrefixRouteHook(Router())
    for spelled in (("1", "1", "2"), (1.0, 1.0, 2.0), (True, True, 2), ("+1", 1.0, "2")):
        assert places(hook, ordered(*spelled)) == {"gpu0", "gpu1"}, spelled
    in_model_info = group()
    for deployment, order in zip(in_model_info, (1, 1, 2), strict=True):
        deployment["model_info"]["order"] = order
    assert places(hook, in_model_info) == {"gpu0", "gpu1"}
    assert places(hook, ordered(1.5, "first", 2)) == {"gpu2"}  # no order LiteLLM reads: only the order-2 one has one


def attempt_kwargs(
    call_id: str, metadata: dict[str, Any], deployment: str | None = None, **more: Any
) -> dict[str, Any]:
    """The ``kwargs`` LiteLLM gives the deployment hook and the callbacks of one attempt."""
    params: dict[str, Any] = {"metadata": metadata}
    if deployment is not None:
        params["model_info"] = {"id": deployment}
    return {"litellm_call_id": call_id, "metadata": metadata, "litellm_params": params, **more}


def test_calls_sharing_one_metadata_dict_each_end_their_own_decision() -> None:
    """Each attempt's decision is tied, as it is sent, to its ``litellm_call_id``, so its callback ends it even when
    the shared ``metadata`` dict names another call's decision by then: the other call's filter ran in between."""
    hook = PrefixRouteHook(Router())
    shared: dict[str, Any] = {}
    sent: dict[str, str] = {}
    tied: list[str] = []
    both_routed, done = asyncio.Event(), asyncio.Event()

    async def call(call_id: str, text: str) -> None:
        messages = [{"role": "system", "content": f"{text} " * 40}, {"role": "user", "content": "x"}]
        (kept,) = await hook.async_filter_deployments("fake", group(), messages, {"metadata": shared})
        sent[call_id] = kept["model_info"]["id"]
        await both_routed.wait()
        await hook.async_pre_call_deployment_hook(attempt_kwargs(call_id, shared), None)
        tied.append(call_id)
        await done.wait()  # the call runs on: its task's end would finish its decision

    async def run() -> None:
        calls = [asyncio.create_task(call("a", "first"))]
        while "a" not in sent:
            await asyncio.sleep(0)
        calls.append(asyncio.create_task(call("b", "second")))  # the metadata then names b's decision
        while "b" not in sent:
            await asyncio.sleep(0)
        both_routed.set()
        while len(tied) < 2:
            await asyncio.sleep(0)
        assert hook.router.stats().in_flight == 2
        await hook.async_log_success_event(attempt_kwargs("a", shared, sent["a"]), None, None, None)
        assert hook.router.stats().in_flight == 1 and hook.router.in_flight(sent["b"]) == 1
        await hook.async_log_success_event(attempt_kwargs("b", shared, sent["b"]), None, None, None)
        assert hook.router.stats().in_flight == 0
        done.set()
        await asyncio.gather(*calls)
        assert hook.router.stats().in_flight == 0 and hook.router.stats().ignored == 0

    asyncio.run(run())
    assert hook.errors == 0


class Unreadable(Mapping[str, Any]):
    """A mapping whose every read raises."""

    def __getitem__(self, key: str) -> Any:
        raise RuntimeError("unreadable")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("unreadable")

    def __len__(self) -> int:
        return 1


def test_each_error_in_a_callback_is_counted_once_and_never_raised() -> None:
    """At request time the hook never raises into LiteLLM: an error is logged and counted in ``hook.errors``."""
    hook = PrefixRouteHook(Router())

    async def run() -> None:
        await hook.async_pre_call_deployment_hook(Unreadable(), None)  # type: ignore[arg-type]
        assert hook.errors == 1
        metadata: dict[str, Any] = {}
        await hook.async_filter_deployments("fake", group(), CHAT, {"metadata": metadata})
        unwatchable = attempt_kwargs("a", metadata, litellm_logging_obj=5)  # an int takes no weak reference
        await hook.async_pre_call_deployment_hook(unwatchable, None)
        assert hook.errors == 2
        await hook.async_log_success_event(Unreadable(), None, None, None)
        await hook.async_log_failure_event(Unreadable(), None, None, None)
        assert hook.errors == 4
        passed: Any = hook.async_post_call_streaming_iterator_hook(None, _chunks(), Unreadable())
        assert [chunk async for chunk in passed] == [1, 2]
        assert hook.errors == 5
        await hook.async_log_success_event(attempt_kwargs("a", metadata), None, None, None)
        assert hook.router.stats().in_flight == 0 and hook.errors == 5

    asyncio.run(run())


class Call:
    """A stand-in for LiteLLM's logging object of one call (it takes weak references)."""


def test_a_stream_whose_callbacks_never_come_ends_when_its_logging_object_is_gone() -> None:
    """Its decision ends on the loop once the call's logging object is collected, at once where the loop is closed
    by then; a callback that came first ends it, and the object's end then finishes nothing more."""
    hook = PrefixRouteHook(Router())
    calls = [Call(), Call(), Call()]

    async def send(call_id: str, call: Call) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        await hook.async_filter_deployments("fake", group(), CHAT, {"metadata": metadata, "stream": True})
        await hook.async_pre_call_deployment_hook(attempt_kwargs(call_id, metadata, litellm_logging_obj=call), None)
        return metadata

    async def run() -> None:
        await asyncio.create_task(send("dropped", calls[0]))  # a stream outlives its task
        metadata = await asyncio.create_task(send("read", calls[1]))
        assert hook.router.stats().in_flight == 2
        del calls[0]
        await asyncio.sleep(0)
        assert hook.router.stats().in_flight == 1
        await hook.async_log_success_event(attempt_kwargs("read", metadata), None, None, None)
        del calls[0]
        await asyncio.sleep(0)
        assert hook.router.stats().in_flight == 0 and hook.router.stats().ignored == 0
        await asyncio.create_task(send("late", calls[0]))

    asyncio.run(run())
    assert hook.router.stats().in_flight == 1
    del calls[0]  # collected after its loop closed
    assert hook.router.stats().in_flight == 0 and hook.router.stats().ignored == 0 and hook.errors == 0


def test_a_decision_ended_one_way_is_not_ended_again_another_way() -> None:
    """A call ends once: by its callback just after its logging object went (the end then due on the loop finishes
    nothing more, and raises nothing there), by its logging object's end while its task runs on (then the task's
    end finishes nothing more), by its task's end (then its logging object's end finishes nothing more), or by the
    proxy's stream hook (then its logging object's end finishes nothing more)."""
    hook = PrefixRouteHook(Router())
    calls = [Call(), Call(), Call(), Call()]
    dropped, done = asyncio.Event(), asyncio.Event()

    async def send(call_id: str, call: Call, stream: bool) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        await hook.async_filter_deployments("fake", group(), CHAT, {"metadata": metadata, "stream": stream})
        await hook.async_pre_call_deployment_hook(attempt_kwargs(call_id, metadata, litellm_logging_obj=call), None)
        return metadata

    async def runs_on() -> None:
        await send("dropped", calls[0], stream=False)
        dropped.set()
        await done.wait()

    async def run() -> None:
        failures: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: failures.append(context))
        metadata = await asyncio.create_task(send("raced", calls[0], stream=True))
        del calls[0]  # its end is due on the loop's next iteration, when the callback has ended it
        await hook.async_log_success_event(attempt_kwargs("raced", metadata), None, None, None)
        await asyncio.sleep(0)
        assert failures == [] and hook.router.stats().in_flight == 0
        task = asyncio.create_task(runs_on())
        await dropped.wait()
        del calls[0]
        await asyncio.sleep(0)
        assert hook.router.stats().in_flight == 0
        done.set()
        await task
        await asyncio.create_task(send("returned", calls[0], stream=False))  # its task's end ends it
        await asyncio.sleep(0)  # (its done callback runs after this awaiter's wake-up)
        assert hook.router.stats().in_flight == 0
        del calls[0]
        await asyncio.sleep(0)
        metadata = await asyncio.create_task(send("proxied", calls[0], stream=True))
        passed: Any = hook.async_post_call_streaming_iterator_hook(None, _chunks(), {"metadata": metadata})
        assert [chunk async for chunk in passed] == [1, 2]
        assert hook.router.stats().in_flight == 0
        del calls[0]
        await asyncio.sleep(0)

    asyncio.run(run())
    assert hook.router.stats().in_flight == 0 and hook.router.stats().ignored == 0 and hook.errors == 0


def test_a_stream_that_outlives_its_task_is_not_ended_by_another_call_sharing_its_metadata() -> None:
    """A stream returned by its task (``create_task``/``gather`` of ``acompletion(..., stream=True)``) counts until
    its own callback, and a retry finishes only an earlier decision of its own task: another call that passes the
    same ``metadata`` dict (a module constant) must not end the stream's decision when its filter finds it there."""
    hook = PrefixRouteHook(Router())
    shared: dict[str, Any] = {}
    done = asyncio.Event()

    async def call(text: str, stream: bool) -> None:
        messages = [{"role": "system", "content": f"{text} " * 40}, {"role": "user", "content": "x"}]
        await hook.async_filter_deployments("fake", group(), messages, {"metadata": shared, "stream": stream})
        await hook.async_pre_call_deployment_hook({}, None)  # LiteLLM sends the attempt, in the same task
        if not stream:
            await done.wait()

    async def run() -> None:
        await asyncio.create_task(call("streamed", stream=True))  # the task returns the stream, read later
        metadata = dict(shared)
        other = asyncio.create_task(call("another", stream=False))
        while hook.router.stats().decisions < 2:
            await asyncio.sleep(0)
        assert hook.router.stats().in_flight == 2  # the stream still counts
        done.set()
        await other
        assert hook.router.stats().in_flight == 1
        await hook.async_log_success_event({"litellm_params": {"metadata": metadata}}, None, None, None)
        assert hook.router.stats().in_flight == 0 and hook.router.stats().ignored == 0

    asyncio.run(run())


def test_streams_kept_past_their_tasks_end_are_remembered_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream returned by its task is remembered until its end comes; where none ever comes (no callback, no
    logging object), the table keeps at most the newest ``_MAX_ATTEMPTS`` of them, the rest left to their lease."""
    import prefixroute.adapters.litellm as adapter

    monkeypatch.setattr(adapter, "_MAX_ATTEMPTS", 4)
    hook = PrefixRouteHook(Router(), lease=None)

    async def call(i: int) -> None:
        messages = [{"role": "system", "content": f"stream {i} " * 40}, {"role": "user", "content": "x"}]
        await hook.async_filter_deployments("fake", group(), messages, {"metadata": {}, "stream": True})
        await hook.async_pre_call_deployment_hook({}, None)  # sent (a call filtered, never sent, ends with its task)

    async def run() -> None:
        for i in range(10):
            await asyncio.create_task(call(i))  # each task returns its stream and ends
        await asyncio.sleep(0)  # the tasks' done callbacks

    asyncio.run(run())
    assert hook.router.stats().in_flight == 10  # every stream still counts: nothing ended it
    assert len(hook._task_of) == 4
