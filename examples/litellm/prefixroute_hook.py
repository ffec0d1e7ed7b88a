"""The prefixroute hook that examples/litellm/config.yaml loads into the LiteLLM Proxy (``callbacks``).

LiteLLM imports this file and takes its ``hook``. To count real tokens, pass the model's tokenizer:
``encoder=TokenizerEncoder(PromptTokenizer.from_file("/models/llama/tokenizer.json"))``.
"""

from __future__ import annotations

from prefixroute import Router
from prefixroute.adapters.litellm import PrefixRouteHook

hook = PrefixRouteHook(Router(), model_groups=["fake-model"])
