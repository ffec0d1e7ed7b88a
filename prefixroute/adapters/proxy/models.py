"""``/v1/models`` as the proxy reads it from its backends: only model objects, merged by id.

A backend's answer is a peer's, not the client's: it is checked before any of it reaches a client. An answer that is
no OpenAI model list (not JSON, not an object, a ``data`` that is not a list, larger than :data:`MAX_MODELS_BYTES`)
raises :class:`UnreadableModels`, and the proxy skips that backend; within a list, an entry that is no model object
is dropped, and the others kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_MODELS_BYTES", "UnreadableModels", "merge_cards", "model_cards"]

MAX_MODELS_BYTES = 16 * 2**20
"""The most of a backend's ``/v1/models`` answer read: a vLLM lists its model and LoRA adapters in a few hundred
bytes each, so this is tens of thousands of them; a larger answer is no model list."""


class UnreadableModels(ValueError):
    """A backend's ``/v1/models`` answer is not an OpenAI model list; the message says why."""


def model_cards(raw: bytes) -> list[dict[str, Any]]:
    """The model objects of a ``/v1/models`` answer's ``data``, in order, each id once (its first card).

    A model object is a JSON object whose ``id`` is a printable string, not blank, and whose ``object``, when it has
    one, is ``"model"`` (vLLM's cards have ``object``, ``created``, ``owned_by``, ``root``, ``parent`` and
    ``max_model_len`` too; they are kept as they came). Any other entry (``{"id": 5}``, a card without an id, a
    string) is dropped. O(len(raw)).

    Raises:
        UnreadableModels: ``raw`` is not JSON (or nests deeper than Python's recursion limit), not a JSON object, or
            its ``data`` is not a list.
    """
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UnreadableModels(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict):
        raise UnreadableModels(f"a JSON {type(document).__name__}, not an object")
    data = document.get("data")
    if not isinstance(data, list):
        raise UnreadableModels(f"its 'data' is {type(data).__name__}, not a list")
    return merge_cards([[card for card in data if _is_model(card)]])


def merge_cards(lists: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The cards of ``lists`` (each :func:`model_cards`'), merged by id: the first card of each id, in the order
    they come. O(cards)."""
    merged: dict[str, dict[str, Any]] = {}
    for cards in lists:
        for card in cards:
            merged.setdefault(card["id"], card)
    return list(merged.values())


def _is_model(card: object) -> bool:
    if not isinstance(card, dict):
        return False
    model_id = card.get("id")
    named = isinstance(model_id, str) and model_id.isprintable() and model_id.strip() != ""
    return named and card.get("object", "model") == "model"
