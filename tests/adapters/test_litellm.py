"""The LiteLLM adapter inside a real ``LiteLLMRouter`` whose deployments are fake vLLM engines on loopback."""

from __future__ import annotations

import os

# LiteLLM fetches its model price map from the internet at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import importlib  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.exceptions import BadRequestError, InternalServerError  # noqa: E402
from litellm.router import Router as LiteLLMRouter  # noqa: E402

from prefixroute import Candidate, LoadPolicy, Router  # noqa: E402
from prefixroute.adapters.litellm import DEPLOYMENT_KEY, METADATA_KEY, PrefixRouteHook  # noqa: E402
from prefixroute.adapters.proxy.prompts import INLINE_TEXT  # noqa: E402
from prefixroute.errors import ConfigurationError  # noqa: E402
from prefixroute.testing.openai_engine import OpenAIEngine  # noqa: E402

from ..conftest import running_engines
from .conftest import LoopNoting

SYSTEM = "You are a careful assistant. " * 20
yaml: Any = importlib.import_module("yaml")  # a LiteLLM dependency; its stubs are not
EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(3, max_tokens=3)


@pytest.fixture
def hook(engines: list[OpenAIEngine]) -> Iterator[PrefixRouteHook]:
    hook = PrefixRouteHook(Router())
    litellm.logging_callback_manager.add_litellm_callback(hook)
    yield hook
    litellm.logging_callback_manager.remove_callback_from_all_lists(hook)
    for engine in engines:
        engine.resume()
        engine.fail_next(0)


def model_list(engines: list[OpenAIEngine]) -> list[dict[str, Any]]:
    return [
        {"model_name": "fake", "model_info": {"id": f"gpu{i}"},
         "litellm_params": {"model": "hosted_vllm/fake-model", "api_base": f"{engine.url}/v1", "api_key": "none"}}
        for i, engine in enumerate(engines)
    ]  # fmt: skip


def ask(router: LiteLLMRouter, text: str, **options: Any) -> Any:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return router.acompletion(model="fake", messages=messages, **options)


async def settled(hook: PrefixRouteHook) -> None:
    """Every counter back to exactly 0 (LiteLLM runs its callbacks on a logging worker, a moment later)."""
    for _ in range(500):
        if hook.router.stats().in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert hook.router.stats().in_flight == 0
    for candidate in hook.router.decide([1] * 64, ["gpu0", "gpu1", "gpu2"]).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)


def requests(engines: list[OpenAIEngine]) -> list[int]:
    return [engine.stats().requests for engine in engines]


def test_the_same_prefix_goes_to_the_same_deployment(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    router = LiteLLMRouter(model_list=model_list(engines))

    async def run() -> None:
        # LiteLLM runs success callbacks on its logging worker, a moment after the call returns: let each land
        # before the next request, or the first one still counts as load and may push the next elsewhere.
        await ask(router, "first question")
        await settled(hook)
        stream = await ask(router, "second question", stream=True)
        async for _ in stream:
            pass
        await settled(hook)
        await ask(router, "third question")
        await settled(hook)

    before = requests(engines)
    asyncio.run(run())
    served = [after - b for after, b in zip(requests(engines), before, strict=True)]
    assert sorted(served) == [0, 0, 3]
    assert hook.router.stats().commits == 3


def test_an_error_finishes_the_request_and_a_retry_lands_elsewhere(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    async def run() -> None:
        for engine in engines:
            engine.fail_next(1)
        plain = LiteLLMRouter(model_list=model_list(engines), num_retries=0)
        with pytest.raises(InternalServerError):
            await ask(plain, "fails")
        await settled(hook)
        for engine in engines:
            engine.fail_next(0)
        retrying = LiteLLMRouter(model_list=model_list(engines), num_retries=1, retry_after=0)
        first = (await ask(retrying, "fails once"))._hidden_params["model_id"]
        await settled(hook)
        decisions = hook.router.stats().decisions
        engines[int(first[-1])].fail_next(1)
        before = requests(engines)
        reply = await ask(retrying, "fails once")
        assert reply._hidden_params["model_id"] != first  # the retry was routed again, elsewhere
        served = [after - b for after, b in zip(requests(engines), before, strict=True)]
        assert served[int(first[-1])] == 1 and sum(served) == 2
        assert hook.router.stats().decisions == decisions + 2
        await settled(hook)

    asyncio.run(run())


def test_an_engines_refusal_forgets_the_prediction_and_a_server_error_keeps_it(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """A 400 (vLLM's for a prompt past its context) reaches the failure callback as a ``BadRequestError`` with
    ``status_code`` 400: the engine cached nothing, so the router forgets the blocks it predicted there."""

    async def run() -> None:
        plain = LiteLLMRouter(model_list=model_list(engines), num_retries=0)
        for status, error in ((400, BadRequestError), (500, InternalServerError)):
            for engine in engines:
                engine.fail_next(1, status=status)
            with pytest.raises(error):
                await ask(plain, f"answered {status}")
            await settled(hook)
            held = sum(len(hook.router.index.hashes(backend)) for backend in ("gpu0", "gpu1", "gpu2"))
            assert (held > 0) == (status == 500), status

    asyncio.run(run())


def test_load_spills_over_under_concurrency(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    router = LiteLLMRouter(model_list=model_list(engines))
    for engine in engines:
        engine.stall()

    async def run() -> None:
        tasks = [asyncio.ensure_future(ask(router, f"user {i}")) for i in range(9)]
        while hook.router.stats().in_flight < 9:
            await asyncio.sleep(0.01)
        loads = sorted(hook.router.in_flight(f"gpu{i}") for i in range(3))
        assert loads[-1] < 9 and loads[0] + loads[1] > 0
        for engine in engines:
            engine.resume()
        await asyncio.gather(*tasks)
        await settled(hook)

    asyncio.run(run())


def test_the_proxy_config_loads_the_hook() -> None:
    from litellm.proxy.types_utils.utils import get_instance_fn

    config_file = EXAMPLES / "litellm" / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    (callback,) = config["litellm_settings"]["callbacks"]
    instance = get_instance_fn(callback, config_file_path=str(config_file))
    assert isinstance(instance, PrefixRouteHook)
    assert {entry["model_name"] for entry in config["model_list"]} == set(instance._groups or ())


def test_each_model_group_routes_in_its_own_namespace(engines: list[OpenAIEngine]) -> None:
    """A LoRA adapter's group never matches the base group's prefixes, even on deployments with the same ids."""
    hook = PrefixRouteHook(Router(), base_groups=["fake"])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]

    def deployments(group: str) -> list[dict[str, Any]]:
        return [{"model_name": group, "model_info": {"id": f"gpu{i}"}} for i in range(3)]

    async def pick(group: str) -> str:
        metadata: dict[str, Any] = {}
        (chosen,) = await hook.async_filter_deployments(group, deployments(group), messages, {"metadata": metadata})
        hook.router.finish(metadata["prefixroute_decision"])
        return str(chosen["model_info"]["id"])

    async def run() -> None:
        base = await pick("fake")
        tokens = hook._encoder.encode_chat(messages)
        ids = [f"gpu{i}" for i in range(3)]
        assert hook.router.decide(tokens, ids).backend == base  # the base group: the router's own namespace
        assert all(c.matched_tokens == 0 for c in hook.router.decide(tokens, ids, namespace="sql").candidates)
        await pick("sql")
        assert hook.router.decide(tokens, ids, namespace="sql").matched_tokens > 0

    asyncio.run(run())


class Exploding(LoadPolicy):
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        raise ValueError("policy bug")  # what a bad prompt raises too: still the policy's fault, and counted


def group(n: int = 3, name: str = "fake") -> list[dict[str, Any]]:
    return [{"model_name": name, "model_info": {"id": f"gpu{i}"}} for i in range(n)]


CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]


def test_bad_options_raise_when_given() -> None:
    with pytest.raises(ConfigurationError, match="lease"):
        PrefixRouteHook(Router(), lease=-1)
    with pytest.raises(ConfigurationError, match="lease"):
        PrefixRouteHook(Router(), lease="600")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model_groups"):
        PrefixRouteHook(Router(), model_groups="llama")  # a str would be a set of letters
    with pytest.raises(TypeError, match="base_groups"):
        PrefixRouteHook(Router(), base_groups=[1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="encoder"):
        PrefixRouteHook(Router(), encoder=object())  # type: ignore[arg-type]
    assert PrefixRouteHook(Router(), lease=None, model_groups=["llama"])._groups == frozenset({"llama"})


def test_a_policy_that_raises_keeps_litellms_choice() -> None:
    hook = PrefixRouteHook(Router(policy=Exploding()))
    deployments = group()
    metadata: dict[str, Any] = {}
    kept = asyncio.run(hook.async_filter_deployments("fake", deployments, CHAT, {"metadata": metadata}))
    assert kept == deployments and hook.errors == 1 and "prefixroute_decision" not in metadata
    assert hook.router.stats().in_flight == 0


def test_the_filter_leaves_its_decision_and_deployment_in_the_request_metadata() -> None:
    hook = PrefixRouteHook(Router())
    metadata: dict[str, Any] = {}
    (chosen,) = asyncio.run(hook.async_filter_deployments("fake", group(), CHAT, {"metadata": metadata}))
    assert metadata[DEPLOYMENT_KEY] == chosen["model_info"]["id"]
    assert hook.router.in_flight(chosen["model_info"]["id"]) == 1
    hook.router.finish(metadata[METADATA_KEY])  # the decision's id
    assert hook.router.stats().in_flight == 0 and hook.router.stats().ignored == 0


@pytest.mark.parametrize(
    "previous", [5, "gpu0", [{"deployment_id": ["unhashable"]}], [None, {"deployment_id": None}], {"gpu0": 1}]
)
def test_garbage_in_previous_models_still_routes(previous: object) -> None:
    hook = PrefixRouteHook(Router())
    metadata: dict[str, Any] = {"previous_models": previous}
    (chosen,) = asyncio.run(hook.async_filter_deployments("fake", group(), CHAT, {"metadata": metadata}))
    assert hook.router.in_flight(chosen["model_info"]["id"]) == 1 and hook.errors == 0
    asyncio.run(hook.async_log_success_event({"litellm_params": {"metadata": metadata}}, None, None, None))
    assert hook.router.stats().in_flight == 0


class Unreadable:
    def __bool__(self) -> bool:
        raise ValueError("neither true nor false")


def test_a_stream_flag_that_cannot_be_read_counts_nothing() -> None:
    hook = PrefixRouteHook(Router())
    metadata: dict[str, Any] = {}
    request = {"metadata": metadata, "stream": Unreadable()}
    kept = asyncio.run(hook.async_filter_deployments("fake", group(), CHAT, request))
    assert kept == group() and hook.errors == 1 and "prefixroute_decision" not in metadata
    assert hook.router.stats().in_flight == 0


def test_odd_requests_keep_litellms_choice_and_count_nothing() -> None:
    hook = PrefixRouteHook(Router())

    async def run() -> None:
        odd: list[tuple[Any, Any]] = [
            (None, {"metadata": {}}),  # no messages, no prompt
            ([{"role": None, "content": None}], {"metadata": {}}),
            ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {"metadata": {}}),
            (["not a dict"], {"metadata": {}}),
            (None, {"metadata": {}, "prompt": [1, -5]}),  # a bad token id
            (None, {"metadata": {}, "prompt": ["a", "b"]}),
            (CHAT, None),  # no request kwargs: no metadata to carry the decision
            (CHAT, {"metadata": None}),
            (CHAT, "garbage"),
        ]
        for messages, request in odd:
            kept = await hook.async_filter_deployments("fake", group(), messages, request)
            assert len(kept) in (1, 3)
            if isinstance(request, dict) and isinstance(request["metadata"], dict):
                await hook.async_log_success_event({"litellm_params": request}, None, None, None)
        assert await hook.async_filter_deployments("fake", [], CHAT, {"metadata": {}}) == []
        tokens = {"metadata": {}, "prompt": [1, 2, 3]}
        (one,) = await hook.async_filter_deployments("fake", group(1), None, tokens)
        assert one["model_info"]["id"] == "gpu0"
        await hook.async_log_success_event({"litellm_params": tokens}, None, None, None)
        # deployments lacking an id, or sharing one, are never a crash
        mixed: list[Any] = [{"model_info": {}}, {}, None, {"model_info": {"id": 7}}, *group(2), *group(2)]
        metadata: dict[str, Any] = {}
        (chosen,) = await hook.async_filter_deployments("fake", mixed, CHAT, {"metadata": metadata})
        assert chosen in group(2)
        for _ in range(2):  # fired twice, success then failure: finish() is idempotent
            await hook.async_log_success_event({"litellm_params": {"metadata": metadata}}, None, None, None)
            await hook.async_log_failure_event({"litellm_params": {"metadata": metadata}}, None, None, None)
        for kwargs in (None, {}, {"litellm_params": None}, {"litellm_params": {"metadata": {METADATA_KEY: 3}}},
                       {"litellm_params": {"metadata": {METADATA_KEY: "never-seen"}}}):  # fmt: skip
            await hook.async_log_failure_event(kwargs, None, None, None)
            await hook.async_log_success_event(kwargs, None, None, None)

    asyncio.run(run())
    assert hook.router.stats().in_flight == 0 and hook.errors == 0
    for candidate in hook.router.decide([1] * 64, ["gpu0", "gpu1", "gpu2"]).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)


def test_a_retry_finishes_the_earlier_attempt_even_with_no_healthy_deployment() -> None:
    hook = PrefixRouteHook(Router())
    metadata: dict[str, Any] = {}
    asyncio.run(hook.async_filter_deployments("fake", group(), CHAT, {"metadata": metadata}))
    assert hook.router.stats().in_flight == 1
    assert asyncio.run(hook.async_filter_deployments("fake", [], CHAT, {"metadata": metadata})) == []
    assert hook.router.stats().in_flight == 0


def test_a_failed_attempts_late_callback_does_not_finish_the_retry() -> None:
    """LiteLLM shares one metadata dict among a request's attempts and logs on a worker, a moment later."""
    hook = PrefixRouteHook(Router())
    metadata: dict[str, Any] = {}
    request = {"metadata": metadata}

    async def run() -> None:
        (first,) = await hook.async_filter_deployments("fake", group(), CHAT, request)
        failed = first["model_info"]["id"]
        metadata["previous_models"] = ({"deployment_id": failed},)
        (retry,) = await hook.async_filter_deployments("fake", group(), CHAT, request)  # finishes the first attempt
        assert retry["model_info"]["id"] != failed and hook.router.stats().in_flight == 1
        late = {"litellm_params": {"metadata": metadata, "model_info": {"id": failed}}}
        await hook.async_log_failure_event(late, None, None, None)
        assert hook.router.in_flight(retry["model_info"]["id"]) == 1  # the retry still counts
        done = {"litellm_params": {"metadata": metadata, "model_info": retry["model_info"]}}
        await hook.async_log_success_event(done, None, None, None)
        assert hook.router.stats().in_flight == 0

    asyncio.run(run())


def test_a_sync_call_keeps_litellms_choice_and_counts_nothing(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """LiteLLM runs deployment filters on async calls only: a sync call never reaches the hook's filter."""
    router = LiteLLMRouter(model_list=model_list(engines))
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "sync"}]
    router.completion(model="fake", messages=messages)
    for engine in engines:
        engine.fail_next(1)
    with pytest.raises(InternalServerError):
        LiteLLMRouter(model_list=model_list(engines), num_retries=0).completion(model="fake", messages=messages)
    assert hook.router.stats().decisions == 0
    asyncio.run(settled(hook))


def test_text_completions_route_on_their_prompt() -> None:
    """``atext_completion``'s prompt (text, token ids or a batch) comes in ``request_kwargs``, no messages."""
    hook = PrefixRouteHook(Router())

    async def pick(prompt: object) -> str:
        request: dict[str, Any] = {"metadata": {}, "prompt": prompt}
        (chosen,) = await hook.async_filter_deployments("fake", group(), None, request)
        await hook.async_log_success_event({"litellm_params": request}, None, None, None)
        return str(chosen["model_info"]["id"])

    async def run() -> None:
        assert len({await pick(SYSTEM + "one"), await pick([SYSTEM + "two", "x"])}) == 1
        assert len({await pick([*range(100, 164), i]) for i in range(3)}) == 1

    asyncio.run(run())
    assert hook.router.stats().commits == 5 and hook.router.stats().in_flight == 0


def test_a_cancelled_call_stops_counting_when_its_task_ends(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    """LiteLLM calls no callback for a call its caller cancels (a client gone): the calling task's end finishes it,
    streaming or not, whether cancelled before the answer or while reading the stream."""
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)

    async def read(stream: bool) -> None:
        reply = await ask(router, f"cancelled {stream}", stream=stream)
        async for _ in reply:
            pass

    async def run() -> None:
        for stream, stall in ((False, 0), (True, 0), (True, 1)):
            for engine in engines:
                engine.stall(after_tokens=stall)
            task = asyncio.ensure_future(read(stream))
            while hook.router.stats().in_flight < 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for engine in engines:
                engine.resume()
            await settled(hook)
        # a stream returned by its own task (asyncio.gather) still counts until it is read to its end
        gathered: Any
        (gathered,) = await asyncio.gather(ask(router, "gathered", stream=True))
        await asyncio.sleep(0.1)
        assert hook.router.stats().in_flight == 1
        async for _ in gathered:
            pass
        await settled(hook)

    asyncio.run(run())


def test_a_stream_the_proxy_closes_early_stops_counting(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    """The LiteLLM Proxy closes a stream whose client went away (``aclose()``) and calls no success or failure
    callback for it; its request task ends without being cancelled. The proxy runs every stream through the
    callbacks' ``async_post_call_streaming_iterator_hook``: the hook's ends the decision there."""
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)

    async def run() -> None:
        for reads in (1, 0, None):  # closed after one chunk, before any, read to its end
            metadata: dict[str, Any] = {}
            messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "gone"}]
            reply = await router.acompletion(model="fake", messages=messages, stream=True, metadata=metadata)
            assert hook.router.stats().in_flight == 1
            proxied: Any = hook.async_post_call_streaming_iterator_hook(None, reply, {"metadata": metadata})
            count = 0
            async for _ in proxied:
                count += 1
                if reads is not None and count >= reads:
                    break
            await proxied.aclose()
            await reply.aclose()
            assert hook.router.stats().in_flight == 0
            await settled(hook)
        for garbage in (None, {}, {"metadata": None}, {"metadata": {METADATA_KEY: 5}}, "x"):
            passed: Any = hook.async_post_call_streaming_iterator_hook(None, _chunks(), garbage)
            assert [chunk async for chunk in passed] == [1, 2]
        assert hook.errors == 0

    asyncio.run(run())


async def _chunks() -> Any:
    for chunk in (1, 2):
        yield chunk


def test_a_stream_its_caller_closes_early_or_drops_stops_counting(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """Outside the proxy, a stream read partly (``break``, ``aclose()``) or never, then dropped, by a task that goes
    on gets no success or failure callback from LiteLLM: the end of the call's logging object ends its decision."""
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)

    async def read(reads: int, close: bool) -> None:
        reply = await ask(router, f"abandoned {reads} {close}", stream=True)
        count = 0
        async for _ in reply:
            count += 1
            if count >= reads:
                break
        if close:
            await reply.aclose()

    async def run() -> None:
        for reads, close in ((1, False), (1, True), (0, False)):
            if reads:
                await read(reads, close)
            else:
                await ask(router, "never read", stream=True)  # the stream returned is dropped at once
            await settled(hook)
        await read(99, False)  # read to its end: its success callback ends it, once
        await settled(hook)
        assert hook.router.stats().ignored == 0 and hook.errors == 0

    asyncio.run(run())


def test_concurrent_calls_sharing_one_metadata_dict_each_count_until_they_end(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """A caller may pass one metadata dict to every call (a module constant), which LiteLLM writes into. Each call's
    decision must still be its own: counted while its call runs, ended by its own callback, nothing ignored."""
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)
    shared: dict[str, Any] = {"team": "search"}
    for engine in engines:
        engine.stall()

    async def run() -> None:
        before = sum(requests(engines))
        tasks = [asyncio.ensure_future(ask(router, f"shared metadata {i}", metadata=shared)) for i in range(6)]
        for _ in range(500):
            if sum(requests(engines)) >= before + 6:
                break
            await asyncio.sleep(0.01)
        assert hook.router.stats().in_flight == 6  # before: each call's routing ended the call before it
        for engine in engines:
            engine.resume()
        await asyncio.gather(*tasks)
        await settled(hook)  # (a callback after its task ended finishes a second time: ignored, counted)
        assert hook.errors == 0

    asyncio.run(run())


def test_a_long_prompt_is_encoded_off_the_event_loop() -> None:
    """Tokenizing a long prompt on LiteLLM's loop would hold up every other call on it."""
    encoder = LoopNoting()
    hook = PrefixRouteHook(Router(), encoder=encoder)
    long = "x" * INLINE_TEXT

    async def pick(messages: list[dict[str, str]]) -> str:
        request: dict[str, Any] = {"metadata": {}}
        (chosen,) = await hook.async_filter_deployments("fake", group(), messages, request)
        await hook.async_log_success_event({"litellm_params": request}, None, None, None)
        return str(chosen["model_info"]["id"])

    async def run() -> None:
        first = await pick([{"role": "user", "content": long + "a"}])
        assert await pick([{"role": "user", "content": long + "b"}]) == first
        await pick(CHAT)

    asyncio.run(run())
    assert encoder.on_loop == [False, False, True]
    assert hook.router.stats().commits == 3 and hook.router.stats().in_flight == 0


def test_streams_litellm_refuses_after_the_filter_stop_counting_when_their_tasks_end(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """Was: counted (with their prefill and blocks) until their 600 s lease. A call LiteLLM fails after the filters
    (each deployment over its max_parallel_requests: RateLimitError) was never sent and gets no callback; a stream's
    task that ends normally (it caught the error, or gather() holds it) ended only a non-stream's decision."""
    deployments = model_list(engines)
    for deployment in deployments:
        deployment["litellm_params"]["max_parallel_requests"] = 1
    router = LiteLLMRouter(model_list=deployments, num_retries=0)
    for engine in engines:
        engine.stall(after_tokens=1)

    async def one(i: int) -> str:
        stream = await ask(router, "over the limit", stream=True)
        async for _chunk in stream:
            pass
        return "served"

    async def run() -> None:
        calls = [asyncio.ensure_future(one(i)) for i in range(6)]
        for _ in range(500):
            if sum(c.done() for c in calls) >= 3:  # three served at most, one per deployment: the rest refused
                break
            await asyncio.sleep(0.01)
        for engine in engines:
            engine.resume()
        ends = await asyncio.gather(*calls, return_exceptions=True)
        assert any(type(end).__name__ == "RateLimitError" for end in ends), ends
        await settled(hook)
        assert hook.router.stats().ignored == 0 and hook.errors == 0

    asyncio.run(run())


def test_a_task_s_later_call_sharing_its_metadata_leaves_its_open_stream_counted(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """Was: the later call's filter took the open stream's decision, found in the shared dict, for an earlier attempt
    of its own and ended it: the stream counted 0 for the rest of its life, and its own end was ignored. A call's
    retries keep its LiteLLM trace id; a new call gets its own."""
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)
    shared: dict[str, Any] = {"team": "search"}

    async def run() -> None:
        stream = await ask(router, "the open stream", stream=True, metadata=shared)
        chunks = aiter(stream)
        await anext(chunks)
        streaming = shared[DEPLOYMENT_KEY]
        assert hook.router.stats().in_flight == 1
        for i in range(3):
            await ask(router, f"a later call {i}", metadata=shared)
            for _ in range(100):  # its success callback, on LiteLLM's logging worker
                if hook.router.stats().in_flight == 1:
                    break
                await asyncio.sleep(0.01)
            assert hook.router.in_flight(streaming) == 1 and hook.router.stats().in_flight == 1  # the stream
        async for _chunk in chunks:
            pass
        await settled(hook)
        assert hook.router.stats().ignored == 0 and hook.errors == 0

    asyncio.run(run())


def test_a_hook_registered_twice_routes_each_attempt_once(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    """Was: two commits per call, the first decision ended refused by the second filter run (which took it for a
    call LiteLLM failed after the filters). A hook listed twice in ``litellm.callbacks`` (registered by the API and
    appended by hand too) has its filter run twice in one filter pass, with the same request dict: the second run
    keeps the first's deployment. A retry is a new pass and routes again."""
    litellm.callbacks.append(hook)  # the fixture registered it already
    try:
        router = LiteLLMRouter(model_list=model_list(engines), num_retries=1, retry_after=0)

        async def run() -> None:
            before = requests(engines)
            for question in ("first question", "second question", "third question"):
                await ask(router, question)
                await settled(hook)
            served = [after - b for after, b in zip(requests(engines), before, strict=True)]
            assert sorted(served) == [0, 0, 3] and hook.router.stats().commits == 3
            first = (await ask(router, "fails once"))._hidden_params["model_id"]
            await settled(hook)
            engines[int(first[-1])].fail_next(1)
            reply = await ask(router, "fails once")
            assert reply._hidden_params["model_id"] != first  # the retry was routed again, elsewhere
            await settled(hook)
            assert hook.router.stats().commits == 6  # 3 + the first call + the second's two attempts
            assert hook.router.stats().ignored == 0 and hook.errors == 0

        asyncio.run(run())
    finally:
        litellm.callbacks.remove(hook)
