"""How both fakes read a request's numbers as vLLM does (pydantic's lax int, ``SamplingParams``' checks), the
refusal that names the parameter it refuses, and vLLM's answer to a model it does not serve."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from prefixroute._numbers import shown
from prefixroute.testing._names import MAX_MODEL_LEN

__all__ = ["Refused", "lax_int", "model_not_found", "read_max_tokens"]


class Refused(ValueError):
    """What vLLM refuses with a VLLMValidationError naming a parameter: 400, the parameter its answer's ``param``."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def model_not_found(model: object, served: Collection[str]) -> dict[str, Any] | None:
    """vLLM's answer to a request naming a model it does not serve (``OpenAIServing._check_model``: a 404 body with
    ``param`` "model"), or None when ``model`` is one of ``served``, absent, null or ``""`` (vLLM's
    ``_is_model_supported``: no name is the base model). ``model`` is a str or None here (anything else was refused
    as vLLM's ``model: str | None`` is). O(len(served))."""
    if not model or model in served:
        return None
    return {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model",
                      "code": 404}}  # fmt: skip


def lax_int(name: str, value: object) -> int:
    """``value`` as pydantic's lax int reads it: an int, ``16.0`` or ``"16"``.

    Raises:
        ValueError: anything else (vLLM answers 400), e.g. ``true`` or ``1.5``.
    """
    if isinstance(value, float) and value.is_integer() or isinstance(value, str) and value.strip().isdecimal():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {shown(value)}")
    return value


def read_max_tokens(value: object, default: int, prompt_tokens: int) -> int:
    """The tokens to generate, as vLLM reads a request's ``max_tokens`` (None: the engine's default, at most what the
    context leaves): an integer (``16.0`` and ``"16"`` too, pydantic's lax int) of at least 1 that fits the context
    with the (longest) prompt.

    Raises:
        Refused: below 1, as vLLM's SamplingParams refuses it (``param`` "max_tokens", the message ending in the
            parameter and value, as VLLMValidationError's str() ends).
        ValueError: anything else (vLLM answers 400), e.g. ``true``, ``1.5``, or more than the context.
    """
    if value is None:  # vLLM then generates up to the context's end, and refuses a prompt that fills it
        if prompt_tokens >= MAX_MODEL_LEN:
            raise ValueError(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
        return min(default, MAX_MODEL_LEN - prompt_tokens)
    value = lax_int("max_tokens", value)
    if value < 1:
        raise Refused(
            f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})", param="max_tokens"
        )
    if prompt_tokens + value > MAX_MODEL_LEN:
        raise ValueError(
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
            f"{prompt_tokens + value} tokens ({prompt_tokens} in the messages, {value} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return value
