"""Thin adapters that turn a gateway's request into :meth:`prefixroute.Router.route` and back.

Each holds no routing logic of its own. :mod:`prefixroute.adapters.tokenize` serves gateways that see text, not
token ids.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that imports each of its names from its submodule (``homes``: name to
    submodule) on first use, so that importing one submodule does not import the others and their extras."""
    homes = dict(homes)

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return __getattr__
