"""The LiteLLM adapter as a user meets it: a real ``LiteLLMRouter``, fake vLLM engines on loopback, the calls and
messages a LiteLLM application makes, and every count back to exactly 0 whatever happened to the request."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: LiteLLM's bundled price map

import asyncio  # noqa: E402
import gc  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.integrations.custom_logger import CustomLogger  # noqa: E402
from litellm.router import Router as LiteLLMRouter  # noqa: E402
from litellm.router_api import ChangeSet  # noqa: E402

from prefixroute import Router  # noqa: E402
from prefixroute.adapters.litellm import PrefixRouteHook  # noqa: E402
from prefixroute.testing.openai_engine import OpenAIEngine  # noqa: E402

from ..conftest import running_engines
from .conftest import tool_call_conversation

SYSTEM = "You are a careful assistant. " * 20
IDS = ["gpu0", "gpu1", "gpu2"]


@pytest.fixture(scope="module")
def engines() -> Iterator[list[OpenAIEngine]]:
    yield from running_engines(3, max_tokens=3)


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    """Collect after each test, so a socket LiteLLM leaves open warns in the test that opened it."""
    yield
    gc.collect()


@pytest.fixture
def hook(engines: list[OpenAIEngine]) -> Iterator[PrefixRouteHook]:
    hook = PrefixRouteHook(Router(), model_groups=["fake", "other"])
    litellm.logging_callback_manager.add_litellm_callback(hook)
    yield hook
    litellm.logging_callback_manager.remove_callback_from_all_lists(hook)
    for engine in engines:
        engine.resume()
        engine.fail_next(0)
        engine.token_delay_s = 0.0


def deployment(engine: OpenAIEngine | None, id: str, group: str = "fake", **params: Any) -> dict[str, Any]:
    litellm_params = {"model": "hosted_vllm/fake-model", "api_key": "none", **params}
    if engine is not None:
        litellm_params["api_base"] = f"{engine.url}/v1"
    return {"model_name": group, "model_info": {"id": id}, "litellm_params": litellm_params}


def model_list(engines: list[OpenAIEngine], group: str = "fake", prefix: str = "gpu") -> list[dict[str, Any]]:
    return [deployment(engine, f"{prefix}{i}", group) for i, engine in enumerate(engines)]


def chat(text: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


async def settled(hook: PrefixRouteHook, backends: list[str] = IDS) -> None:
    """Every counter back to exactly 0 (LiteLLM runs its callbacks on a logging worker, a moment later; a stream the
    caller stopped reading ends when the collector finalizes it, which a loaded machine may leave for a while, so the
    wait collects now and then, up to 30 s, before it asserts)."""
    for attempt in range(3000):
        if hook.router.stats().in_flight == 0:
            break
        if attempt % 100 == 99:
            gc.collect()
        await asyncio.sleep(0.01)
    assert hook.router.stats().in_flight == 0
    for candidate in hook.router.decide([1] * 64, backends).candidates:
        assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)


def served_by(reply: Any) -> str:
    return str(reply._hidden_params["model_id"])


def test_a_stream_that_breaks_mid_way_stops_counting(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    router = LiteLLMRouter(model_list=model_list(engines))

    async def run() -> None:
        for engine in engines:
            engine.stall(after_tokens=1)
        stream = await router.acompletion(model="fake", messages=chat("break"), stream=True)
        assert hook.router.stats().in_flight == 1
        chunks = 0
        with pytest.raises(Exception):  # noqa: B017, PT011 -- whatever LiteLLM makes of a dropped connection
            async for _ in stream:
                chunks += 1
                if chunks == 1:
                    for engine in engines:
                        engine.refuse()
        for engine in engines:
            engine.accept()
            engine.resume()
        await settled(hook)

    asyncio.run(run())
    assert hook.errors == 0


def test_content_parts_tool_calls_and_images_route_and_finish(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    router = LiteLLMRouter(model_list=model_list(engines))
    conversation = tool_call_conversation()

    async def run() -> list[str]:
        places = []
        for turn in range(3):
            messages = [*conversation, {"role": "user", "content": f"and then {turn}?"}]
            places.append(served_by(await router.acompletion(model="fake", messages=messages)))
            await settled(hook)
        return places

    places = asyncio.run(run())
    assert len(set(places)) == 1, places
    assert hook.router.stats().commits == 3
    assert hook.errors == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # LiteLLM's pooled sockets
def test_token_id_prompts_of_text_completions_route_on_their_prefix(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    # hosted_vllm/ takes no token ids (LiteLLM: "Unmapped prompt format"); OpenAI's text completions do
    tokens = [deployment(e, f"gpu{i}", model="text-completion-openai/fake-model") for i, e in enumerate(engines)]
    router = LiteLLMRouter(model_list=tokens)
    prefixes = [list(range(1000 * g, 1000 * g + 128)) for g in range(1, 4)]

    async def run() -> dict[int, set[str]]:
        places: dict[int, set[str]] = {}
        for turn in range(3):
            for g, prefix in enumerate(prefixes):
                reply = await router.atext_completion(model="fake", prompt=[*prefix, 9000 + turn])
                places.setdefault(g, set()).add(served_by(reply))
                await settled(hook)
        return places

    places = asyncio.run(run())
    assert all(len(where) == 1 for where in places.values()), places
    assert hook.router.stats().commits == 9


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # LiteLLM's pooled sockets
def test_deployments_sharing_one_api_base_or_without_one_are_routed_apart(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    shared = [deployment(engines[0], "a"), deployment(engines[0], "b")]
    router = LiteLLMRouter(model_list=shared)

    async def run() -> None:
        for engine in engines:
            engine.stall()
        calls = [asyncio.create_task(router.acompletion(model="fake", messages=chat("same"))) for _ in range(2)]
        await asyncio.sleep(0.3)
        assert {hook.router.in_flight("a"), hook.router.in_flight("b")} == {1}  # load spills to the other id
        for engine in engines:
            engine.resume()
        await asyncio.gather(*calls)
        await settled(hook, ["a", "b"])

    asyncio.run(run())
    # no api_base at all (LiteLLM answers a mock_response itself): routed on the ids alone
    mocked = [deployment(None, id, mock_response="hi") for id in ("m0", "m1", "m2")]
    router = LiteLLMRouter(model_list=mocked)

    async def mock() -> None:
        places = set()
        for turn in range(3):
            places.add(served_by(await router.acompletion(model="fake", messages=chat(f"t{turn}"))))
            await settled(hook, ["m0", "m1", "m2"])
        assert len(places) == 1

    asyncio.run(mock())
    assert hook.router.stats().commits == 5


def test_deployments_added_and_removed_at_run_time(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    router = LiteLLMRouter(model_list=model_list(engines[:1]))

    async def run() -> None:
        first = served_by(await router.acompletion(model="fake", messages=chat("q")))
        assert first == "gpu0"
        await settled(hook)
        router.add_deployment(litellm.types.router.Deployment(**deployment(engines[1], "gpu1")))
        router.apply(ChangeSet(delete=["gpu0"]))
        again = served_by(await router.acompletion(model="fake", messages=chat("q")))
        assert again == "gpu1"
        await settled(hook)
        router.set_model_list(model_list(engines[2:], prefix="new"))
        last = served_by(await router.acompletion(model="fake", messages=chat("q")))
        assert last == "new0"
        await settled(hook, ["gpu0", "gpu1", "new0"])

    asyncio.run(run())


def test_a_cooled_down_deployment_is_passed_over_and_counts_stay_exact(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    router = LiteLLMRouter(model_list=model_list(engines), allowed_fails=0, cooldown_time=30, num_retries=0)

    async def run() -> None:
        home = served_by(await router.acompletion(model="fake", messages=chat("q")))
        await settled(hook)
        engines[IDS.index(home)].fail_next(1)
        with pytest.raises(litellm.exceptions.InternalServerError):
            await router.acompletion(model="fake", messages=chat("q"))
        await settled(hook)
        for _ in range(3):
            assert served_by(await router.acompletion(model="fake", messages=chat("q"))) != home
            await settled(hook)

    asyncio.run(run())


def test_a_retry_lands_elsewhere_and_fallbacks_to_another_group_balance(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    deployments = [*model_list(engines[:2]), deployment(engines[2], "other0", "other")]
    router = LiteLLMRouter(model_list=deployments, num_retries=1, fallbacks=[{"fake": ["other"]}])

    async def run() -> None:
        home = served_by(await router.acompletion(model="fake", messages=chat("q")))
        await settled(hook, ["gpu0", "gpu1", "other0"])
        engines[IDS.index(home)].fail_next(1)
        retried = served_by(await router.acompletion(model="fake", messages=chat("q")))
        assert retried != home
        await settled(hook, ["gpu0", "gpu1", "other0"])
        engines[0].fail_next(5)
        engines[1].fail_next(5)
        fell = served_by(await router.acompletion(model="fake", messages=chat("q")))
        assert fell == "other0"
        await settled(hook, ["gpu0", "gpu1", "other0"])

    asyncio.run(run())


@pytest.mark.parametrize(("stream", "after_tokens"), [(False, 0), (True, 0), (True, 1)])
def test_a_timeout_shorter_than_the_engine_stops_counting(
    hook: PrefixRouteHook, engines: list[OpenAIEngine], stream: bool, after_tokens: int
) -> None:
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=0)

    async def run() -> None:
        for engine in engines:
            engine.stall(after_tokens=after_tokens)
        with pytest.raises(litellm.exceptions.Timeout):
            reply = await router.acompletion(model="fake", messages=chat("slow"), timeout=0.3, stream=stream)
            async for _ in reply:
                pass
        for engine in engines:
            engine.resume()
        await settled(hook)

    asyncio.run(run())


def test_calls_refused_by_max_parallel_requests_end_at_zero(hook: PrefixRouteHook, engines: list[OpenAIEngine]) -> None:
    deployments = model_list(engines)
    for d in deployments:
        d["litellm_params"]["max_parallel_requests"] = 2
    router = LiteLLMRouter(model_list=deployments, num_retries=1)

    async def run() -> None:
        for engine in engines:
            engine.token_delay_s = 0.02
        ends = await asyncio.gather(
            *(router.acompletion(model="fake", messages=chat("hot")) for _ in range(12)), return_exceptions=True
        )
        refused = [end for end in ends if isinstance(end, litellm.exceptions.RateLimitError)]
        assert refused and len(refused) + sum(not isinstance(end, BaseException) for end in ends) == 12
        await settled(hook)

    asyncio.run(run())


class Raising(CustomLogger):
    async def async_log_success_event(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a buggy logger")

    async def async_log_failure_event(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a buggy logger")


def test_another_callback_that_raises_does_not_leave_a_count(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    raising = Raising()
    litellm.logging_callback_manager.add_litellm_callback(raising)
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=1)

    async def run() -> None:
        await router.acompletion(model="fake", messages=chat("q"))
        await settled(hook)
        for engine in engines:
            engine.fail_next(1)
        with pytest.raises(litellm.exceptions.InternalServerError):
            await router.acompletion(model="fake", messages=chat("q"))
        await settled(hook)

    try:
        asyncio.run(run())
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(raising)


def test_deployments_of_a_lower_priority_order_serve_only_when_the_first_order_cannot(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    """LiteLLM's ``order``: after the filters it keeps the deployments of the lowest order left (of the request's
    ``_target_order`` in its order fallback), so a filter that keeps an order-2 deployment beside healthy order-1
    ones sends the request to the backup."""
    deployments = model_list(engines)
    for d, order in zip(deployments, (1, 1, 2), strict=True):
        d["litellm_params"]["order"] = order

    async def run() -> None:
        router = LiteLLMRouter(model_list=deployments, num_retries=0)
        places = set()
        for prompt in range(12):  # prefixes that spread over every deployment given to the filter
            places.add(served_by(await router.acompletion(model="fake", messages=chat("x", f"{prompt} " * 40))))
            await settled(hook)
        assert places == {"gpu0", "gpu1"}
        engines[0].fail_next(1)
        engines[1].fail_next(1)
        assert served_by(await router.acompletion(model="fake", messages=chat("x", "0 " * 40))) == "gpu2"
        await settled(hook)

    asyncio.run(run())


def test_a_refused_connection_or_a_timeout_is_retried_on_another_deployment(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=1)

    async def run() -> None:
        home = served_by(await router.acompletion(model="fake", messages=chat("r")))
        await settled(hook)
        engines[IDS.index(home)].refuse()
        try:
            assert served_by(await router.acompletion(model="fake", messages=chat("r"))) != home
        finally:
            engines[IDS.index(home)].accept()
        await settled(hook)
        engines[IDS.index(home)].stall()
        assert served_by(await router.acompletion(model="fake", messages=chat("r"), timeout=0.5)) != home
        engines[IDS.index(home)].resume()
        await settled(hook)

    asyncio.run(run())


def test_two_hooks_for_two_groups_each_end_their_own_across_a_fallback(engines: list[OpenAIEngine]) -> None:
    a = PrefixRouteHook(Router(), model_groups=["fake"])
    b = PrefixRouteHook(Router(), model_groups=["other"])
    for h in (a, b):
        litellm.logging_callback_manager.add_litellm_callback(h)
    deployments = [*model_list(engines[:2]), deployment(engines[2], "other0", "other")]
    router = LiteLLMRouter(model_list=deployments, num_retries=0, fallbacks=[{"fake": ["other"]}])

    async def run() -> None:
        await router.acompletion(model="fake", messages=chat("a"))
        await router.acompletion(model="other", messages=chat("a"))
        await settled(a, ["gpu0", "gpu1"])
        await settled(b, ["other0"])
        for e in engines[:2]:
            e.fail_next(1)
        fell = served_by(await router.acompletion(model="fake", messages=chat("a")))
        assert fell == "other0"
        await settled(a, ["gpu0", "gpu1"])
        await settled(b, ["other0"])

    try:
        asyncio.run(run())
    finally:
        for h in (a, b):
            litellm.logging_callback_manager.remove_callback_from_all_lists(h)
        for e in engines:
            e.fail_next(0)
    assert a.router.stats().commits == 2  # the first call and the fallen-back one's attempt


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # LiteLLM's pooled sockets
def test_sixty_calls_of_every_kind_some_failing_some_cancelled_end_at_zero(
    hook: PrefixRouteHook, engines: list[OpenAIEngine]
) -> None:
    router = LiteLLMRouter(model_list=model_list(engines), num_retries=2)

    async def one(i: int) -> str:
        if i % 2:
            stream = await router.acompletion(model="fake", messages=chat(f"q{i % 5}"), stream=True)
            async for _ in stream:
                if i % 3 == 0:
                    break  # the caller stops reading after one chunk
            return "stream"
        if i % 4 == 0:
            r = await router.atext_completion(model="fake", prompt=SYSTEM + f"q{i % 5}", stream=i % 8 == 0)
            if i % 8 == 0:
                async for _ in r:
                    pass
                return "tstream"
            return served_by(r)
        return served_by(await router.acompletion(model="fake", messages=chat(f"q{i % 5}")))

    async def run() -> None:
        for engine in engines:
            engine.token_delay_s = 0.01
        engines[0].fail_next(6)
        tasks = [asyncio.create_task(one(i)) for i in range(60)]
        await asyncio.sleep(0.05)
        for t in tasks[::7]:
            t.cancel()
        ends = await asyncio.gather(*tasks, return_exceptions=True)
        assert {type(end) for end in ends if isinstance(end, BaseException)} <= {asyncio.CancelledError}
        assert len({end for end in ends if isinstance(end, str) and end.startswith("gpu")}) > 1  # the load spilled
        # A retried stream read partly ends with its logging object, which LiteLLM keeps in a reference cycle
        # after a retry: it ends at the next cyclic collection (or its lease), not at once.
        gc.collect()
        await settled(hook)

    asyncio.run(run())
    assert hook.errors == 0
