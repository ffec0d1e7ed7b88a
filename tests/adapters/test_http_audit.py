"""``prefixroute proxy`` and ``prefixroute serve`` against hostile clients and backends found by a black-box audit of
their HTTP contracts (each test failed before its fix)."""

from __future__ import annotations

import httpx
from aiohttp import web

from prefixroute import Router
from prefixroute.adapters.proxy import Proxy

from ..conftest import wait_until
from .conftest import backend_serving

JSON_BODY = {"Content-Type": "application/json"}


def test_headers_the_connection_header_names_are_of_one_connection_and_not_relayed_either_way() -> None:
    seen: list[web.Request] = []

    async def naming(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        headers = {"Connection": "keep-alive, X-Hop", "X-Hop": "the engine's", "X-Kept": "1"}
        return web.json_response({"choices": [{"text": "hi"}]}, headers=headers)

    with backend_serving(naming) as url, Proxy(Router(), [url], base_models=[]) as proxy:
        headers = {**JSON_BODY, "Connection": "keep-alive, X-Internal,x-other", "X-Internal": "the client's",
                   "X-Other": "2", "X-Request-Id": "r1"}  # fmt: skip
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert reply.status_code == 200 and reply.json() == {"choices": [{"text": "hi"}]}
        # RFC 9110 7.6.1: a proxy removes the fields its Connection header names, both ways; the others go on.
        assert "x-hop" not in reply.headers and reply.headers["x-kept"] == "1"
        assert "X-Internal" not in seen[0].headers and "X-Other" not in seen[0].headers
        assert seen[0].headers["X-Request-Id"] == "r1"
        wait_until(lambda: proxy.router.stats().in_flight == 0, what="no request in flight")
