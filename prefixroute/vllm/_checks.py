"""Option checks shared by the vLLM layer: every nonsense number is a ConfigurationError when it is given."""

from __future__ import annotations

import logging
import re
import threading

from prefixroute._arguments import check_backend_id
from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError

__all__ = [
    "MAX_DATA_PARALLEL_SIZE",
    "MAX_SECONDS",
    "check_backend",
    "check_callable",
    "check_count",
    "check_data_parallel_size",
    "check_endpoint",
    "check_seconds",
    "sparse_level",
]

MAX_SECONDS = float(threading.TIMEOUT_MAX)
"""The longest wait a thread can be told to make (``threading.TIMEOUT_MAX``, about 292 years on 64-bit Linux):
a longer one would raise OverflowError in the thread that waits."""

MAX_DATA_PARALLEL_SIZE = 1024
"""The most data-parallel ranks one backend may have: each gets a subscriber thread and a socket, so a typo (60000)
must be an error, not 60000 threads; far above any real deployment (vLLM runs a few to a few dozen ranks)."""


def sparse_level(count: int) -> int:
    """The log level of the ``count``-th occurrence of one repeated problem: WARNING at the 1st, 2nd, 4th, 8th…,
    DEBUG in between, so an engine that keeps sending the same garbage (a misconfigured block size, say) is reported
    with its count without flooding the log. The counters keep the exact figures."""
    return logging.WARNING if count > 0 and count & (count - 1) == 0 else logging.DEBUG


def check_backend(backend: object) -> str:
    """``backend`` as the plain str id the router keys it by: a str subclass kept as a key of its own would hash
    apart from the id that removes it, so a backend removed would go on being written."""
    if not isinstance(backend, str):
        raise InvalidTypeError(f"backend must be a str id, not {type(backend).__name__}")
    return check_backend_id(backend)


def check_seconds(value: object, name: str) -> float:
    """Return ``value`` as a plain float if it is a finite positive number of seconds (any real number but a bool,
    numpy's floats too, read by ``as_float()``) up to :data:`MAX_SECONDS`; else raise ConfigurationError (for a huge
    int such as ``10**400`` too, like ``inf``, rather than OverflowError)."""
    seconds = as_float(value)
    if seconds is None or not 0 < seconds <= MAX_SECONDS:
        raise ConfigurationError(
            f"{name} must be a finite positive number of seconds (at most {MAX_SECONDS:.0f}), not {shown(value)}"
        )
    return seconds


def check_count(value: object, name: str) -> int:
    """Return ``value`` as a Python int if it is a positive integer (numpy's too, not a bool); else raise
    ConfigurationError."""
    count = as_int(value)
    if count is None or count < 1:
        raise ConfigurationError(f"{name} must be a positive int, not {shown(value)}")
    return count


def check_data_parallel_size(value: object, name: str = "data_parallel_size") -> int:
    """Return ``value`` as a Python int if it is an int in [1, :data:`MAX_DATA_PARALLEL_SIZE`] (numpy's too, not a
    bool); else raise ConfigurationError naming the bound."""
    size = as_int(value)
    if size is None or not 1 <= size <= MAX_DATA_PARALLEL_SIZE:
        raise ConfigurationError(f"{name} must be an int in [1, {MAX_DATA_PARALLEL_SIZE}], not {shown(value)}")
    return size


def check_callable(value: object, name: str, what: str, *, optional: bool = False) -> None:
    """Raise TypeError unless ``value`` is callable (or None when ``optional``); ``what`` describes the call."""
    if value is None and optional:
        return
    if not callable(value):
        raise InvalidTypeError(
            f"{name} must be a callable {what}{' or None' if optional else ''}, not {type(value).__name__}"
        )


# The characters libzmq's connect() takes in a tcp:// address (socket_base.cpp's check): a host name or address, an
# IPv6 one with its zone, an optional "source;" part. Any other (a "," or "/" of two addresses run together) is EINVAL
# there, which a subscriber's thread would retry for ever.
_TCP_ADDRESS = re.compile(r"[A-Za-z0-9\[:][A-Za-z0-9.\-:%;\[\]_*]*")


def check_endpoint(value: object, name: str, example: str) -> str:
    """Return ``value`` if it is a ZMQ address a socket can connect to, else raise ConfigurationError: ``tcp://``
    with a host and a port in 1-65535 (``*`` binds, it does not connect) in the characters libzmq takes, or a
    named ``ipc://`` or ``inproc://``."""
    if isinstance(value, str) and value.isprintable() and " " not in value:
        scheme, _, address = value.partition("://")
        host, _, port = address.rpartition(":")
        if (
            scheme == "tcp"
            and _TCP_ADDRESS.fullmatch(address)
            and host not in ("", "*")
            and port.isdigit()  # ASCII digits: the pattern takes no other character
            and 0 < int(port) < 65536
        ):
            return value
        if scheme in ("ipc", "inproc") and address:
            return value
    raise ConfigurationError(f"{name} must be a ZMQ address to connect to, like {example!r}, not {shown(value)}")
