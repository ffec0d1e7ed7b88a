"""The token ids an OpenAI request routes on, encoded off the event loop when its text is long."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prefixroute.adapters.proxy.prompts import INLINE_TEXT, BadRequest, ByteEncoder, request_tokens_async

from .conftest import LoopNoting

LONG = "y" * INLINE_TEXT


@pytest.mark.parametrize(
    ("body", "chat", "on_loop"),
    [
        ({"prompt": "short"}, False, True),
        ({"prompt": LONG}, False, True),  # not over the limit
        ({"prompt": LONG + "y"}, False, False),
        ({"prompt": [LONG + "y", "b"]}, False, False),  # a batch routes on its first prompt
        ({"prompt": ["b", LONG + "y"]}, False, True),
        ({"messages": [{"role": "user", "content": LONG}]}, True, False),  # the message's markers count too
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONG}] * 2}]}, True, False),
        ({"messages": [{"role": "user", "content": "hi"}] * 100}, True, True),
    ],
)
def test_long_text_is_encoded_on_a_worker_thread(body: dict[str, Any], chat: bool, on_loop: bool) -> None:
    encoder = LoopNoting()
    tokens = asyncio.run(request_tokens_async(body, chat=chat, encoder=encoder))
    assert encoder.on_loop == [on_loop]
    assert tokens == asyncio.run(request_tokens_async(body, chat=chat, encoder=ByteEncoder()))


@pytest.mark.parametrize("body", [None, [LONG], {"prompt": 5}, {"messages": LONG}, {"messages": [LONG * 2]}])
def test_what_cannot_be_read_is_refused_as_inline(body: object) -> None:
    chat = isinstance(body, dict) and "messages" in body
    with pytest.raises(BadRequest):
        asyncio.run(request_tokens_async(body, chat=chat, encoder=ByteEncoder()))
