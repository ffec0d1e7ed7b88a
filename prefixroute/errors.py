"""The exception tree. Catch :class:`PrefixRouteError` to handle every error prefixroute raises itself.

::

    PrefixRouteError
    ├── ConfigurationError     a bad option or argument: unknown policy name, negative capacity, a backend twice
    ├── InvalidPromptError     a token id that is not an int in [0, 2**32), or an unsupported prompt type
    ├── InvalidTypeError       an argument of the wrong type: a list where a str is due, None for a Decision
    ├── NoBackendError         route() was given no backend to choose from (also a LookupError)
    ├── PolicyError            a policy returned something that is not one of its candidates, or raised (a TypeError)
    ├── DecisionError          a decision given to a router that did not make it, or committed elsewhere
    ├── InvalidEventError      a malformed vLLM KV-cache event
    ├── InvalidTraceError      a malformed line in a workload trace
    ├── MetricsError           unreadable Prometheus metrics text
    └── StateError             a call the object's state does not allow: a Simulation run twice, a figure of a
                               request that never produced it, a fake engine's URL before it started, a second
                               start() of a server that is serving

The sidecar's refusals (:class:`prefixroute.adapters.serve.BadRequest`, with the HTTP status it answers) are
``PrefixRouteError`` too.

Each error is also the builtin a Python user would catch: ``ConfigurationError``, ``InvalidPromptError``,
``DecisionError``, ``InvalidEventError``, ``InvalidTraceError`` and ``MetricsError`` (figures that could not be
read, also when fetching them failed) are ``ValueError``, ``NoBackendError`` a
``LookupError``, ``PolicyError`` and ``InvalidTypeError`` a ``TypeError``, ``StateError`` a ``RuntimeError``.
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DecisionError",
    "InvalidEventError",
    "InvalidPromptError",
    "InvalidTraceError",
    "InvalidTypeError",
    "MetricsError",
    "NoBackendError",
    "PolicyError",
    "PrefixRouteError",
    "StateError",
]


class PrefixRouteError(Exception):
    """Base class of every error prefixroute raises itself."""


class ConfigurationError(PrefixRouteError, ValueError):
    """An option has a value prefixroute cannot use; the message names the option and the valid values."""


class InvalidPromptError(PrefixRouteError, ValueError):
    """A prompt cannot be hashed: the message names the first bad position and the allowed range."""


class InvalidTypeError(PrefixRouteError, TypeError):
    """An argument has the wrong type (a str where a list of backend ids is due, None where a Decision is); the
    message names the argument and the type it takes. A ``TypeError`` too, as Python's own type checks raise. An
    option given a value it cannot use, of whatever type (a float or a str for a size or a count, anything but True
    or False for a flag), is a :class:`ConfigurationError`, with one exception: a ``seed`` of a type no seed has (a
    float, None where a seed is due) is an ``InvalidTypeError`` in the policies and the simulator, as
    :class:`random.Random`'s own check is a ``TypeError`` (the fake engines of :mod:`prefixroute.testing` check
    theirs with their other options, a :class:`ConfigurationError`)."""


class NoBackendError(PrefixRouteError, LookupError):
    """There is no backend to route to (an empty backend list)."""


class PolicyError(PrefixRouteError, TypeError):
    """A :class:`~prefixroute.LoadPolicy` returned something other than one of the candidates it was given, or its
    ``choose()`` raised an exception that is not a :class:`PrefixRouteError` (the original is this error's cause):
    a fault of the policy, which a gateway answers as its own (HTTP 500), not as the client's."""


class DecisionError(PrefixRouteError, ValueError):
    """A :class:`~prefixroute.Decision` was passed to a router that did not make it, or committed to a backend that
    was not one of its candidates."""


class InvalidEventError(PrefixRouteError, ValueError):
    """A malformed index update: a vLLM KV-cache event or event batch that does not follow vLLM's wire format, or a
    block hash outside [0, 2**64) given to the index's write path."""


class InvalidTraceError(PrefixRouteError, ValueError):
    """A workload trace has a malformed record; the message names the file and line."""


class MetricsError(PrefixRouteError, ValueError):
    """Prometheus metrics text could not be fetched or parsed."""


class StateError(PrefixRouteError, RuntimeError):
    """A call that the object's present state does not allow, whatever its arguments: running a
    :class:`~prefixroute.sim.Simulation` a second time, asking a request record for a time to first token it never
    had, restarting a KV-event subscriber whose previous thread has not ended, starting a proxy or a fake engine that
    is serving already. The message says what to do instead.
    A ``RuntimeError`` too, as Python's own state checks raise."""
