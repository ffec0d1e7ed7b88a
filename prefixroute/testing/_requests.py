"""How both fakes read a request as vLLM does (its body and field types as FastAPI and pydantic read them, pydantic's
lax int, ``SamplingParams``' checks), the refusals, with the types and parameters vLLM names, and vLLM's answer to a
model it does not serve."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from prefixroute._numbers import shown
from prefixroute.testing._names import MAX_MODEL_LEN

__all__ = [
    "Invalid",
    "Refused",
    "Unparsable",
    "check_types",
    "error_body",
    "json_object",
    "lax_int",
    "model_not_found",
    "read_max_tokens",
]


class Refused(ValueError):
    """What vLLM refuses with a VLLMValidationError naming a parameter: 400, the parameter its answer's ``param``."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class Invalid(ValueError):
    """What vLLM's request model (pydantic) refuses before any of its serving code runs: FastAPI's
    RequestValidationError, which vLLM's handler answers 400 with type ``"Bad Request"`` (the status phrase) and
    ``param`` the field's location (``body.max_tokens``; ``body`` for the body as a whole or a model validator's
    ValueError; a VLLMValidationError's parameter when a model validator raised one; None where FastAPI names no
    field)."""

    def __init__(self, message: str, *, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class Unparsable(ValueError):
    """A body FastAPI cannot read as JSON text (no UTF-8): its own 400, ``{"detail": "There was an error parsing the
    body"}``, raised as a Starlette HTTPException, which vLLM's handler (registered for FastAPI's subclass) does not
    take."""


def error_body(exc: Exception) -> dict[str, Any]:
    """vLLM's 400 body for a refusal: an :class:`Invalid` as its RequestValidationError handler answers it (type
    ``"Bad Request"``), an :class:`Unparsable` as FastAPI does, any other as ``create_error_response`` does (type
    ``"BadRequestError"``, ``param`` a :class:`Refused`'s parameter, else null). The message is the fake's own words.
    O(1)."""
    if isinstance(exc, Unparsable):
        return {"detail": str(exc)}
    kind = "Bad Request" if isinstance(exc, Invalid) else "BadRequestError"
    param = exc.param if isinstance(exc, (Invalid, Refused)) else None
    return {"error": {"message": str(exc), "type": kind, "param": param, "code": 400}}


def json_object(raw: bytes) -> dict[str, Any]:
    """The request body as FastAPI reads it for vLLM's request model: JSON (bytes: a UTF-8 BOM is allowed) holding
    an object. O(len(raw)).

    Raises:
        Invalid: JSON FastAPI cannot decode (``param`` ``body.<position>``, as its json_invalid error is located), an
            empty body (``param`` "body", pydantic's missing body) or one that is no object (``param`` "body").
        Unparsable: a body that is no UTF-8 text.
    """
    if not raw:  # FastAPI reads no JSON from an empty body: the request model finds its body missing
        raise Invalid("Field required: the request has no body", param="body")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise Invalid(str(exc), param=f"body.{exc.pos}") from None
    except UnicodeDecodeError:  # FastAPI's own 400 (a Starlette HTTPException, which vLLM's handler does not take)
        raise Unparsable("There was an error parsing the body") from None
    if not isinstance(body, dict):
        raise Invalid("the request body must be a JSON object", param="body")
    return body


def check_types(body: dict[str, Any]) -> None:
    """Refuse a ``model`` or ``request_id`` of another type than vLLM's request models give them (``str | None``;
    ``str``, a random one when absent). O(1).

    Raises:
        Invalid: as pydantic refuses them (``param`` ``body.model`` or ``body.request_id``).
    """
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise Invalid(f"'model' must be a string, not {type(body['model']).__name__}", param="body.model")
    if "request_id" in body and not isinstance(body["request_id"], str):
        raise Invalid(
            f"request_id: Input should be a valid string, not {shown(body['request_id'])}", param="body.request_id"
        )


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
        Invalid: anything else (vLLM's pydantic model answers 400, ``param`` ``body.<name>``), e.g. ``true`` or
            ``1.5``.
    """
    if isinstance(value, float) and value.is_integer() or isinstance(value, str) and value.strip().isdecimal():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{name} must be an integer, not {shown(value)}", param=f"body.{name}")
    return value


def read_max_tokens(value: object, default: int, prompt_tokens: int, *, name: str = "max_tokens") -> int:
    """The tokens to generate, as vLLM reads a request's ``max_tokens`` (None: the engine's default, at most what the
    context leaves): an integer (``16.0`` and ``"16"`` too, pydantic's lax int) of at least 1 that fits the context
    with the (longest) prompt. ``name``: the field it was read from (``max_completion_tokens`` for a chat that gave
    it), for the ``param`` of an :class:`Invalid`.

    Raises:
        Refused: below 1, as vLLM's SamplingParams refuses it (``param`` "max_tokens", the message ending in the
            parameter and value, as VLLMValidationError's str() ends).
        Invalid: no integer (:func:`lax_int`), e.g. ``true`` or ``1.5``.
        ValueError: more than the context (vLLM answers 400).
    """
    if value is None:  # vLLM then generates up to the context's end, and refuses a prompt that fills it
        if prompt_tokens >= MAX_MODEL_LEN:
            raise ValueError(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
            )
        return min(default, MAX_MODEL_LEN - prompt_tokens)
    value = lax_int(name, value)
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
