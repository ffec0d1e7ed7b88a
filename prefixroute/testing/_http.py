"""How vLLM's FastAPI app answers what none of its routes serves, for both fakes: FastAPI's 404 and 405 bodies, and
the CORS headers of Starlette's CORSMiddleware as vLLM adds it by default (``--allowed-origins``, ``--allowed-methods``
and ``--allowed-headers`` all ``*``, no credentials)."""

from __future__ import annotations

import json
from typing import Any, Protocol

__all__ = [
    "JSON",
    "METHOD_NOT_ALLOWED",
    "NOT_FOUND",
    "PREFLIGHT_BODY",
    "SSE",
    "cors_headers",
    "is_preflight",
    "json_body",
    "preflight_headers",
]

JSON = "application/json"
"""The Content-Type of vLLM's JSON answers (Starlette's JSONResponse adds no charset to it)."""

SSE = "text/event-stream; charset=utf-8"
"""The Content-Type of vLLM's streamed answers (a StreamingResponse of ``text/event-stream``, to which Starlette adds
the charset of a ``text/`` type), the only header vLLM sets on them."""

NOT_FOUND = b'{"detail":"Not Found"}'
"""FastAPI's body for a path no route serves (404)."""

METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
"""FastAPI's body for a path served with another method (405, with an ``Allow`` header naming it)."""

PREFLIGHT_BODY = b"OK"
"""CORSMiddleware's body for a preflight (200, ``text/plain; charset=utf-8``)."""


class _Headers(Protocol):
    """A request's headers, looked up by name case-insensitively (http.server's and aiohttp's)."""

    def __contains__(self, name: str, /) -> bool: ...


_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT, QUERY"  # Starlette's ALL_METHODS, for allow_methods=["*"]


def json_body(content: Any) -> bytes:
    """``content`` rendered as Starlette's JSONResponse renders vLLM's answers: compact, UTF-8 (no ``\\u`` escapes).
    O(size)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def is_preflight(method: str, headers: _Headers) -> bool:
    """Whether CORSMiddleware answers this request itself: an ``OPTIONS`` with an ``Origin`` and an
    ``Access-Control-Request-Method`` header, on any path (vLLM routes none of them). ``headers``: the request's header
    names, case-insensitive (http.server's and aiohttp's are). O(1)."""
    return method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers


def preflight_headers(requested: str | None) -> dict[str, str]:
    """The headers of CORSMiddleware's 200 to a preflight that asked for the headers ``requested`` (its
    ``Access-Control-Request-Headers``; all are allowed, so it names them back). O(len(requested))."""
    headers = {"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": _METHODS,
               "Access-Control-Max-Age": "600"}  # fmt: skip
    if requested is not None:
        headers["Access-Control-Allow-Headers"] = requested
    return headers


def cors_headers(headers: _Headers) -> dict[str, str]:
    """The header CORSMiddleware adds to any other answer to a request with an ``Origin`` (none without). O(1)."""
    return {"Access-Control-Allow-Origin": "*"} if "Origin" in headers else {}
