"""Option checks shared by the vLLM layer: every nonsense number is a ConfigurationError when it is given."""

from __future__ import annotations

import math

from prefixroute.errors import ConfigurationError


def check_seconds(value: object, name: str) -> float:
    """Return ``value`` as float if it is a finite positive number of seconds; else raise ConfigurationError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite positive number of seconds, not {value!r}")
    return float(value)


def check_count(value: object, name: str) -> int:
    """Return ``value`` if it is a positive int; else raise ConfigurationError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive int, not {value!r}")
    return value
