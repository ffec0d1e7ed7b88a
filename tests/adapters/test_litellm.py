"""The LiteLLM adapter inside a real ``LiteLLMRouter`` whose deployments are fake vLLM engines on loopback."""

from __future__ import annotations

import os

# LiteLLM fetches its model price map from the internet at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import asyncio  # noqa: E402
import importlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import litellm  # noqa: E402
import pytest  # noqa: E402
from litellm.exceptions import InternalServerError  # noqa: E402
from litellm.router import Router as LiteLLMRouter  # noqa: E402

from prefixroute import Router  # noqa: E402
from prefixroute.adapters.litellm import PrefixRouteHook  # noqa: E402
from prefixroute.testing.openai_engine import OpenAIEngine  # noqa: E402

from ..conftest import running_engines

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
