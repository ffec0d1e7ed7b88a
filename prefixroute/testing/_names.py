"""The names a fake engine serves (``/v1/models`` ids, the ``model_name`` label of its metrics), checked once for
both fakes."""

from __future__ import annotations

from collections.abc import Iterable

from prefixroute._numbers import shown
from prefixroute.errors import ConfigurationError

__all__ = ["check_served_names"]


def check_served_names(
    model: object, lora_adapters: object, *, model_option: str = "model", adapters_option: str = "lora_adapters"
) -> tuple[str, tuple[str, ...]]:
    """``model`` and ``lora_adapters`` checked as the names an engine serves (``/v1/models`` ids): each a printable
    str that is not blank and has no lone surrogate (it could not be sent as UTF-8), the adapters distinct and none
    named as the model (a request naming it would be ambiguous). ``*_option`` name them in messages (a CLI's flags).

    Raises:
        ConfigurationError: ``model`` is not a str or ``lora_adapters`` not a collection of str (a str alone is not),
            whatever they are instead (an option given a value it cannot use, errors.py); a name that is blank, not
            printable or holds a lone surrogate, an adapter listed twice or named as the model.
    """
    if not isinstance(model, str):
        raise ConfigurationError(f"{model_option} must be a str, not {shown(model)}")
    if isinstance(lora_adapters, (str, bytes)) or not isinstance(lora_adapters, Iterable):
        raise ConfigurationError(
            f"{adapters_option} must be a collection of adapter names (str), not {shown(lora_adapters)}"
        )
    adapters = tuple(lora_adapters)
    for option, name in [(model_option, model), *((adapters_option, a) for a in adapters)]:
        if not isinstance(name, str):
            raise ConfigurationError(f"{option} must hold names (str), not {shown(name)}")
        if not name.strip() or not name.isprintable():  # a lone surrogate is not printable (category Cs)
            raise ConfigurationError(
                f"{option} must name a model in printable text (no lone surrogate), not blank, not {shown(name)}"
            )
    repeated = sorted({a for a in adapters if adapters.count(a) > 1})
    if repeated:
        raise ConfigurationError(f"{adapters_option} lists {', '.join(map(repr, repeated))} twice: name each once")
    if model in adapters:
        raise ConfigurationError(
            f"{adapters_option} names the base model {model!r}: an adapter needs a name of its own"
        )
    return model, adapters
