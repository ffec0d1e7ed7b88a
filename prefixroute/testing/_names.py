"""The names a fake engine serves (``/v1/models`` ids, the ``model_name`` label of its metrics), checked once for
both fakes, and the ``/v1/models`` answer that lists them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prefixroute._numbers import shown
from prefixroute.errors import ConfigurationError

__all__ = ["MAX_MODEL_LEN", "check_served_names", "model_list"]

MAX_MODEL_LEN = 1 << 20
"""The context length the fakes serve (``max_model_len`` in ``/v1/models``): prompt plus generated tokens."""


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


def model_list(
    model: str, lora_adapters: Iterable[str], *, created: int, permission_ids: Iterator[str]
) -> dict[str, Any]:
    """The ``/v1/models`` answer of a vLLM serving ``model`` and ``lora_adapters``, as its show_available_models
    makes it: a card for the base model (with ``max_model_len``) and one per adapter (its ``parent`` the base model,
    no ``max_model_len``), each made at ``created`` with one ModelPermission (vLLM's defaults) of the next id. O(n)."""
    served = [
        (model, model, None, MAX_MODEL_LEN),
        *((name, f"/adapters/{name}", model, None) for name in lora_adapters),
    ]
    cards = []
    for name, root, parent, max_model_len in served:
        permission = {"id": next(permission_ids), "object": "model_permission", "created": created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}  # fmt: skip
        cards.append({"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                      "parent": parent, "max_model_len": max_model_len, "permission": [permission]})  # fmt: skip
    return {"object": "list", "data": cards}
