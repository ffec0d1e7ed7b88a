"""``prefixroute proxy``: an OpenAI-compatible router in front of vLLM servers (extra ``prefixroute[proxy]``).

:class:`Proxy` serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models``,
``/metrics`` and ``/healthz``, routing each request with a :class:`~prefixroute.Router`; the command line
(:mod:`prefixroute.adapters.proxy.cli`) builds one from options.
"""

from __future__ import annotations

from prefixroute.adapters.proxy.app import Proxy, ProxyStats
from prefixroute.adapters.proxy.prompts import ByteEncoder, PromptEncoding, TokenizerEncoder

__all__ = ["ByteEncoder", "PromptEncoding", "Proxy", "ProxyStats", "TokenizerEncoder"]
