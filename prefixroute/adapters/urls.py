"""The one check of a backend URL that the proxy and the sidecar accept (they put it in request lines and headers),
and of the address their commands listen on."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

from prefixroute.errors import ConfigurationError, InvalidTypeError

__all__ = ["check_backend_url", "check_distinct", "engine_of", "host_port", "listen_host"]


def check_backend_url(url: object, *, path: bool = True) -> str:
    """Return ``url`` without a trailing ``/`` if it is an ``http(s)://host[:port]`` URL (with a ``/path`` when
    ``path``), else raise. O(len(url)).

    Refused: anything but printable ASCII (a CR or LF from a file with Windows line endings, which ``urlsplit`` would
    silently drop, or a host not yet in its ``xn--`` form), credentials (``user:pass@``: they would leak into the
    decision headers and metrics labels), a query or fragment, a port outside 1-65535 (no engine listens on 0), and
    a path ending in ``/v1`` (an OpenAI client's ``base_url``: the requests go to the engine's ``/v1/...`` paths, so
    every one would have been a 404 from ``/v1/v1/...``).

    Raises:
        ConfigurationError: the message says what is wrong with the URL.
        TypeError: ``url`` is not a str.
    """
    if not isinstance(url, str):
        raise InvalidTypeError(f"a backend URL is a str, not {type(url).__name__}")
    example = "http://gpu0:8000"
    if not url.isascii() or not url.isprintable() or " " in url:
        raise ConfigurationError(
            f"backend URL {url!r} holds a blank, a control character or a non-ASCII character: write it like "
            f"{example} (an internationalised host in its xn-- form)"
        )
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in [0, 65535]
    except ValueError as exc:
        raise ConfigurationError(f"backend URL {url!r} is not a valid URL ({exc}): write it like {example}") from None
    if parts.port == 0:
        raise ConfigurationError(f"backend URL {url!r} has port 0, which no engine listens on: write it like {example}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"backend {url!r} is not an http(s):// URL with a host, like {example}")
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError(
            f"backend URL {url!r} holds credentials: give the host alone (clients' Authorization headers are forwarded)"
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigurationError(f"backend URL {url!r} has a query or fragment: give scheme, host and port only")
    if not path and parts.path not in ("", "/"):
        raise ConfigurationError(
            f"backend {url!r} has a path: give each engine's scheme, host and port only, like {example}"
        )
    trimmed = url.rstrip("/")
    if trimmed.lower().endswith("/v1"):  # an OpenAI client's base_url: every request would go to /v1/v1/...
        raise ConfigurationError(
            f"backend URL {url!r} ends in /v1: give the engine's own URL, {trimmed[:-3]!r}; requests go to its "
            "/v1/completions and /v1/chat/completions"
        )
    return trimmed


def engine_of(url: str) -> str:
    """The one spelling of a checked backend URL's engine: ``http://GPU0`` and ``http://gpu0:80/`` are both
    ``http://gpu0:80`` (scheme and host in lower case, the scheme's default port written out, no trailing ``/``), so
    a list that names one engine twice is found however it is spelt. O(len(url)).

    >>> engine_of("HTTP://GPU0:08000/v1/") == engine_of("http://gpu0:8000/v1")
    True
    """
    parts = urlsplit(url)
    port = parts.port if parts.port is not None else 443 if parts.scheme.lower() == "https" else 80
    return f"{parts.scheme.lower()}://{host_port(parts.hostname or '', port)}{parts.path.rstrip('/')}"


def check_distinct(urls: Sequence[str], engines: Sequence[str]) -> None:
    """Raise if two of the backend ``urls`` name one engine (``engines``, each URL's engine as the caller spells
    it): it would count as two backends, its load and its cache split. The message names both spellings. O(n).

    >>> check_distinct(["http://gpu0", "http://gpu1"], ["gpu0:80", "gpu1:80"])
    >>> check_distinct(["http://gpu0", "http://GPU0:80"], ["gpu0:80", "gpu0:80"])
    Traceback (most recent call last):
    ...
    prefixroute.errors.ConfigurationError: backends list 'http://gpu0' and 'http://GPU0:80', one engine (gpu0:80): \
list each backend once
    """
    first: dict[str, str] = {}
    for url, engine in zip(urls, engines, strict=True):
        if engine in first:
            named = (
                f"{url!r} twice" if first[engine] == url else f"{first[engine]!r} and {url!r}, one engine ({engine})"
            )
            raise ConfigurationError(f"backends list {named}: list each backend once")
        first[engine] = url


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL and gRPC write it: an IPv6 address in brackets (``::1:8000`` is no address). O(1).

    >>> host_port("127.0.0.1", 8000), host_port("::1", 8000)
    ('127.0.0.1:8000', '[::1]:8000')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_host(text: str) -> str:
    """``--host`` of the commands that listen: a host name or address, not empty (which would listen on every
    interface, as ``0.0.0.0`` says openly) nor holding a blank, a control or a non-ASCII character, nor a name the
    resolver refuses before looking it up (an empty label or one over 63 characters: ``getaddrinfo`` raises
    UnicodeError, not OSError, for those). An IPv6 address in brackets, as a URL writes it (``[::1]``), is the
    address. O(len(text)).

    Raises:
        argparse.ArgumentTypeError: what is wrong (argparse prints it as one line and exits 2).
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise InvalidTypeError(f"a host is a str, not {type(text).__name__}")
    if text.startswith("[") and text.endswith("]"):  # an IPv6 address as a URL writes it, copied from one
        try:
            return str(ipaddress.IPv6Address(text[1:-1]))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an IPv6 address between the brackets, not {text!r}") from None
    try:
        encodable = bool(text) and text.isascii() and text.isprintable() and " " not in text and text.encode("idna")
    except UnicodeError:  # "gpu0..lan", ".gpu0", a label of 64 characters
        encodable = False
    if not encodable:
        raise argparse.ArgumentTypeError(
            f"expected a host name or address such as 127.0.0.1, ::1 or 0.0.0.0 (every interface), not {text!r}"
        )
    return text
