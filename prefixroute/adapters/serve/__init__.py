"""``prefixroute serve``: the decision sidecar that lets nginx, HAProxy and Envoy route with prefixroute.

:class:`Sidecar` is the HTTP contract over a :class:`~prefixroute.Router` (a raw ASGI app, served by uvicorn);
:mod:`~prefixroute.adapters.serve.release` is the UDP release listener for proxies' end-of-request log lines;
:mod:`~prefixroute.adapters.serve.ext_proc` is the Envoy endpoint picker. Needs the ``prefixroute[serve]`` extra.
See ``docs/adapters.md`` for the proxy set-ups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixroute.adapters import lazy_names

if TYPE_CHECKING:
    from prefixroute.adapters.serve.app import CLIENT_LEFT, Sidecar, upstream_of
    from prefixroute.adapters.serve.contract import BadRequest
    from prefixroute.adapters.serve.release import ReleaseProtocol, release_ids
    from prefixroute.adapters.serve.text import PromptEncoder

__all__ = ["CLIENT_LEFT", "BadRequest", "PromptEncoder", "ReleaseProtocol", "Sidecar", "release_ids", "upstream_of"]

# Imported on first use: the LiteLLM and Ray adapters use contract.py without this package's own extra (uvicorn,
# grpcio).
__getattr__ = lazy_names(
    __name__,
    {
        "CLIENT_LEFT": "app",
        "Sidecar": "app",
        "upstream_of": "app",
        "BadRequest": "contract",
        "ReleaseProtocol": "release",
        "release_ids": "release",
        "PromptEncoder": "text",
    },
)
