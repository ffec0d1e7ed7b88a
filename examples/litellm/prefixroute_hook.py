"""The prefixroute hook that examples/litellm/config.yaml loads into the LiteLLM Proxy (``callbacks``).

LiteLLM imports this file and takes its ``hook``. To route on the tokens the engine caches, pass the model's local
folder (its tokenizer.json and chat template): ``encoder=PromptEncoder("/models/llama")``, with
``from prefixroute.adapters.serve.text import PromptEncoder``.
"""

from __future__ import annotations

from prefixroute import Router
from prefixroute.adapters.litellm import PrefixRouteHook

hook = PrefixRouteHook(Router(), model_groups=["fake-model"])
