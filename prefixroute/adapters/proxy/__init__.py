"""``prefixroute proxy``: an OpenAI-compatible router in front of vLLM servers (extra ``prefixroute[proxy]``).

:class:`Proxy` serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models``,
``/metrics`` and ``/healthz``, routing each request with a :class:`~prefixroute.Router`; the command line
(:mod:`prefixroute.adapters.proxy.cli`) builds one from options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixroute.adapters import lazy_names

if TYPE_CHECKING:
    from prefixroute.adapters.proxy.app import Proxy, ProxyStats
    from prefixroute.adapters.proxy.prompts import ByteEncoder, PromptEncoding, TokenizerEncoder

__all__ = ["ByteEncoder", "PromptEncoding", "Proxy", "ProxyStats", "TokenizerEncoder"]

# Imported on first use: the LiteLLM and Ray adapters use prompts.py without this package's own extra (aiohttp,
# pyzmq, prometheus-client).
__getattr__ = lazy_names(
    __name__,
    {
        "Proxy": "app",
        "ProxyStats": "app",
        "ByteEncoder": "prompts",
        "PromptEncoding": "prompts",
        "TokenizerEncoder": "prompts",
    },
)
