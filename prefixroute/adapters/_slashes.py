"""Where vLLM's FastAPI app redirects a path with trailing slashes: the proxy and both fake engines answer so.

Starlette's ``redirect_slashes`` (on in vLLM's app) answers a request that no route serves, but one would serve
without its trailing slashes, with a 307 to that route, whatever the method. :func:`slash_redirect` is the address
it sends the client to; :func:`request_redirect` reads it from an aiohttp request (aiohttp is not imported here, so
the fake engine served by :mod:`http.server` needs no ``[proxy]`` extra).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Container
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["request_redirect", "slash_redirect"]

# A Host header as Starlette's URL accepts one (starlette/_utils.py: a reg-name, an IPv4 or a bracketed IPv6 address,
# and a port of at most 65535); another is not written into a Location.
_HOST_HEADER = re.compile(r"(?:[a-z0-9._~%!$&'()*+,;=-]+|\[(?P<ipv6>[a-f0-9]*:[a-f0-9.:]+)\])(?::0*(?P<port>[0-9]+))?",
                          re.IGNORECASE)  # fmt: skip
_DEFAULT_PORTS = MappingProxyType({"http": 80, "https": 443})


def slash_redirect(
    path: str, *, routes: Container[str], scheme: str, host: str, local: object, query: str
) -> str | None:
    """Where vLLM's FastAPI app (Starlette's ``redirect_slashes``) sends a request for ``path`` (percent-decoded, as
    Starlette routes it) that one of the ``routes`` serves without its trailing slashes, whatever the method (with a
    307): ``{scheme}://{host}{route}?{query}``, the raw ``query`` as sent, at the ``host`` of the Host header if
    valid, else at ``local``, the listening socket's ``(address, port, ...)``. None for any other path, or when
    neither names a host. O(len(path)).

    >>> slash_redirect("/v1/models//", routes={"/v1/models"}, scheme="http", host="gpu0:8000", local=None, query="")
    'http://gpu0:8000/v1/models'
    """
    route = path.rstrip("/")
    if route == path or not route or route not in routes:
        return None
    if not _valid_host(host):
        if not isinstance(local, tuple) or len(local) < 2:
            return None
        address = f"[{local[0]}]" if ":" in local[0] else local[0]
        host = address if local[1] == _DEFAULT_PORTS.get(scheme) else f"{address}:{local[1]}"
    return f"{scheme}://{host}{route}?{query}" if query else f"{scheme}://{host}{route}"


def request_redirect(request: web.Request) -> str | None:
    """:func:`slash_redirect` for an aiohttp ``request``, the routes those of its application. O(len(path) + routes)."""
    local = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return slash_redirect(
        request.path,
        routes={resource.canonical for resource in request.app.router.resources()},
        scheme=request.scheme,
        host=request.headers.get("Host", ""),
        local=local,
        query=request.raw_path.partition("?")[2],
    )


def _valid_host(host: str) -> bool:
    valid = _HOST_HEADER.fullmatch(host)
    if valid is None or (valid["port"] is not None and (len(valid["port"]) > 5 or int(valid["port"]) > 65535)):
        return False
    if valid["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(valid["ipv6"])
        except ValueError:  # [1:2:3]
            return False
    return True
