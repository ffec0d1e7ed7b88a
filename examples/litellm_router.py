"""Prefix-aware routing inside a ``LiteLLMRouter``: three fake vLLM engines, one model group, one hook.

Runs offline: ``python examples/litellm_router.py`` (needs ``prefixroute[litellm,proxy]``).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: LiteLLM's bundled price map

import litellm  # noqa: E402
from litellm.router import Router as LiteLLMRouter  # noqa: E402

from prefixroute import Router  # noqa: E402
from prefixroute.adapters.litellm import PrefixRouteHook  # noqa: E402
from prefixroute.testing.openai_engine import OpenAIEngine  # noqa: E402

SYSTEMS = ["You answer questions about SQL. " * 30, "You write short poems. " * 30, "You review Python code. " * 30]


async def main() -> None:
    engines = [OpenAIEngine(seed=i, max_tokens=4).start() for i in range(3)]
    hook = PrefixRouteHook(Router())
    try:
        router = LiteLLMRouter(
            model_list=[
                {
                    "model_name": "fake",
                    "model_info": {"id": f"gpu{i}"},
                    "litellm_params": {"model": "hosted_vllm/fake-model", "api_base": f"{e.url}/v1", "api_key": "none"},
                }
                for i, e in enumerate(engines)
            ],  # fmt: skip
            num_retries=1,
        )
        # After the LiteLLM Router: its own filters (a budget limiter) narrow the deployments before the hook picks.
        litellm.logging_callback_manager.add_litellm_callback(hook)
        placed: Counter[tuple[int, str]] = Counter()
        for turn in range(4):
            for i, system in enumerate(SYSTEMS):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]
                reply = await router.acompletion(model="fake", messages=messages)
                placed[i, reply._hidden_params["model_id"]] += 1
        for (prompt, deployment), count in sorted(placed.items()):
            print(f"system prompt {prompt}: {count} requests on {deployment}")
        cached = sum(e.stats().cached_tokens for e in engines) / sum(e.stats().prompt_tokens for e in engines)
        print(f"engine prefix-cache hit rate: {cached:.0%}")
    finally:
        litellm.logging_callback_manager.remove_callback_from_all_lists(hook)
        for engine in engines:
            engine.stop()


if __name__ == "__main__":
    asyncio.run(main())
