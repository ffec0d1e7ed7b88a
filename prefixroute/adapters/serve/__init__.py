"""``prefixroute serve``: the decision sidecar that lets nginx, HAProxy and Envoy route with prefixroute.

:class:`Sidecar` is the HTTP contract over a :class:`~prefixroute.Router` (a raw ASGI app, served by uvicorn);
:mod:`~prefixroute.adapters.serve.release` is the UDP release listener for proxies' end-of-request log lines;
:mod:`~prefixroute.adapters.serve.ext_proc` is the Envoy endpoint picker. Needs the ``prefixroute[serve]`` extra.
See ``docs/adapters.md`` for the proxy set-ups.
"""

from __future__ import annotations

from prefixroute.adapters.serve.app import Sidecar, upstream_of
from prefixroute.adapters.serve.contract import BadRequest
from prefixroute.adapters.serve.release import ReleaseProtocol, release_ids
from prefixroute.adapters.serve.text import PromptEncoder

__all__ = ["BadRequest", "PromptEncoder", "ReleaseProtocol", "Sidecar", "release_ids", "upstream_of"]
