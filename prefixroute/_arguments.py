"""How the router, and the adapters that take the same options, read their callers' arguments: plain values
out, a clear error from the exception tree for anything else."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prefixroute._numbers import as_float, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError, NoBackendError

__all__ = ["EMPTY_ID", "check_backend_id", "check_backends", "check_lease", "id_of", "iterable_of", "lease_deadline"]


def iterable_of(value: object, what: str, items: str) -> Iterable[Any]:
    """``value`` if it is iterable (a str is not), else a TypeError that says what ``what`` must be."""
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Iterable)
        or (isinstance(value, memoryview) and value.ndim != 1)  # which raises NotImplementedError when iterated
    ):
        raise InvalidTypeError(f"{what} must be an iterable of {items}, not {type(value).__name__}")
    return value


def id_of(decision: object) -> str:
    """The id a lifecycle call names, as a plain str (a subclass's own ``__hash__`` must not reach the live-request
    table, where it could raise from finish()): "" (no request) for anything without a str id, also an object
    whose ``id`` attribute raises."""
    if type(decision) is str:
        return decision
    try:
        value = decision if isinstance(decision, str) else getattr(decision, "id", "")
    except Exception:  # noqa: BLE001 - finish() is called in finally blocks and never raises for an id
        return ""
    if type(value) is str:
        return value
    return str.__str__(value) if isinstance(value, str) else ""


def lease_deadline(now: object, lease: float) -> float:
    """When a lease that starts at the clock reading ``now`` ends; a clock that returns no finite number of seconds
    is refused before anything is recorded (a NaN deadline would stop every later lease from expiring)."""
    start = as_float(now)
    if start is None:
        raise ConfigurationError(
            f"the router's clock returned {shown(now)}: a clock must return a finite number of seconds for leases"
        )
    deadline = start + lease
    if not math.isfinite(deadline):
        raise ConfigurationError(
            f"a lease of {shown(lease)} s from the clock's reading {shown(now)} ends past the largest float: "
            "give a shorter lease"
        )
    return deadline


def read_clock(clock: Callable[[], object]) -> float:
    """A clock option read once when it is given: its reading as a float, or a ConfigurationError (from what it
    raised) for a clock that raises or returns no finite number of seconds, so it fails at construction rather than
    at every later call that reads it."""
    try:
        reading = clock()
    except Exception as exc:
        raise ConfigurationError(
            f"clock raised {type(exc).__name__} ({exc}) when read: give a callable that returns seconds, "
            "as time.monotonic"
        ) from exc
    start = as_float(reading)
    if start is None:
        raise ConfigurationError(
            f"clock returned {shown(reading)}: it must return a finite number of seconds, as time.monotonic"
        )
    return start


def check_lease(lease: object) -> float | None:
    """A lease option as seconds (None: no lease), refused unless it is a positive, finite number."""
    if lease is None:
        return None
    seconds = as_float(lease)
    if seconds is None or seconds <= 0:
        raise ConfigurationError(f"lease must be a positive, finite number of seconds or None, not {shown(lease)}")
    return seconds


def check_backend_id(backend: object) -> str:
    """``backend`` as a plain str: a str subclass's own ``__hash__`` or ``__eq__`` must not reach the router's maps
    and caches, where it would fail every later call that meets it."""
    if not isinstance(backend, str):
        raise InvalidTypeError(f"backend ids must be str, not {type(backend).__name__} ({shown(backend)})")
    if not backend:
        raise ConfigurationError(EMPTY_ID)
    return backend if type(backend) is str else str.__str__(backend)


EMPTY_ID = "a backend id is an empty str: give each backend a non-empty id, such as its URL"


def check_backends(backends: Sequence[str]) -> tuple[str, ...]:
    """``backends`` as a tuple of plain str ids, read in one pass: the placement cache is keyed by that tuple and
    sorts it, so a list that another thread changes, or a subclass whose ``__iter__`` yields something else on a
    second pass, cannot store one list's order under another's key. (A list's tuple is the copy the cache key made
    before, so the hot path does no more.)"""
    if isinstance(backends, str):
        raise InvalidTypeError("backends must be a sequence of backend ids, not a single str: wrap it in a list")
    if type(backends) is not tuple:
        try:
            backends = tuple(backends)
        except (TypeError, NotImplementedError):  # not iterable, or a 2-D memoryview
            raise InvalidTypeError(
                f"backends must be a sequence of backend ids, not {type(backends).__name__}"
            ) from None
    if not backends:
        raise NoBackendError("route() needs at least one backend, but the backend list is empty")
    if not set(map(type, backends)) <= {str}:  # C-level; before the duplicate check, which needs hashable ids
        backends = tuple([check_backend_id(backend) for backend in backends])
    ids = set(backends)
    if "" in ids:
        raise ConfigurationError(EMPTY_ID)
    if len(ids) != len(backends):
        seen: set[str] = set()
        duplicate = next(b for b in backends if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise ConfigurationError(
            f"backend {shown(duplicate)} appears more than once in backends; pass each backend once"
        )
    return backends
