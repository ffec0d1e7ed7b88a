"""The Envoy ext_proc endpoint picker against the Gateway API Inference Extension endpoint-picker contract, as an
independent client reads it (found by an audit; the message-by-message rules are in test_ext_proc.py)."""

from __future__ import annotations

import asyncio

import pytest

from prefixroute import Router
from prefixroute.adapters.serve import Sidecar
from prefixroute.adapters.serve.ext_proc import start_ext_proc
from prefixroute.errors import ConfigurationError


@pytest.mark.parametrize("backend", ["http://localhost:8000", "http://gpu0:8000", "https://vllm.example.com"])
def test_a_backend_named_by_host_name_is_refused_as_envoy_connects_to_an_ip_port(backend: str) -> None:
    """The contract names the endpoint ``<ip:port>``, and the example's ORIGINAL_DST cluster connects to an address,
    not a name: with ``http://localhost:8001``, every routed request got Envoy's 503 "no healthy upstream" (tested on
    Envoy 1.40), not even the fail-open pool. The picker refuses such a backend at start, naming it."""
    sidecar = Sidecar(Router(), backends=["http://10.0.0.1:8000", backend])
    with pytest.raises(
        ConfigurationError, match=f"^the endpoint picker names each engine to Envoy as ip:port .*{backend!r}"
    ):
        asyncio.run(start_ext_proc(sidecar, "127.0.0.1", 0))


def test_backends_named_by_ipv4_or_ipv6_address_are_served() -> None:
    sidecar = Sidecar(Router(), backends=["http://10.0.0.1:8000", "http://[::1]:8000", "http://127.0.0.1"])

    async def go() -> None:
        server, _ = await start_ext_proc(sidecar, "127.0.0.1", 0)
        await server.stop(None)

    asyncio.run(go())
