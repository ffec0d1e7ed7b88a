"""Fixtures the adapter tests share."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from prefixroute.adapters.proxy.prompts import ByteEncoder
from prefixroute.adapters.threaded import ServerThread

TOOL_CALL_SYSTEM = "You are a careful assistant. " * 20


def tool_call_conversation() -> list[dict[str, Any]]:
    """A chat as a tool-using client sends it: a system prompt in content parts, a user turn with an image part, an
    assistant turn with no content and a tool call, and the tool's answer (a fresh copy each call)."""
    return [
        {"role": "system", "content": [{"type": "text", "text": TOOL_CALL_SYSTEM}]},
        {"role": "user", "content": [{"type": "text", "text": "weather?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip


CORPUS = ["You are a helpful assistant that answers questions about SQL databases.",
          "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC;"] * 20  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder: a BPE tokenizer.json trained here and a tokenizer_config.json with a chat template."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "<s>"]))
    folder = tmp_path_factory.mktemp("model")
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    template += "{% if add_generation_prompt %}[assistant]{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    return folder


def metric_samples(reply: httpx.Response) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of a ``GET /metrics`` reply, parsed as Prometheus does: name -> sorted labels -> value."""
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain"), reply.text
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


class LoopNoting(ByteEncoder):
    """A ByteEncoder that notes, for each text (a chat's serialised), whether it was encoded on a thread running an
    event loop."""

    def __init__(self) -> None:
        self.on_loop: list[bool] = []

    def encode(self, text: str) -> list[int]:
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        return super().encode(text)


async def request_during_close(client: socket.socket, closing: asyncio.Future[Any]) -> None:
    """Send a /healthz request on ``client``, a connection the server accepted just before ``closing`` (its close)
    began, and assert a graceful close: the request answered 200 or refused (a reset, or closed unanswered), then the
    connection closed and the close done, each within 5 s (an unserved connection waits for ever)."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(client, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await asyncio.wait_for(loop.sock_recv(client, 65536), 5):
            received += chunk
    assert received == b"" or received.startswith(b"HTTP/1.1 200 OK\r\n"), received
    await asyncio.wait_for(closing, 5)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextmanager
def backend_serving(completions: Handler, models: Handler | None = None) -> Iterator[str]:
    """A backend whose ``POST /v1/completions`` is ``completions`` (and ``GET /v1/models``, ``models``), on loopback;
    yields its URL."""
    runner = web.AppRunner(web.Application())
    runner.app.router.add_post("/v1/completions", completions)
    if models is not None:
        runner.app.router.add_get("/v1/models", models)
    urls: list[str] = []

    async def serve() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")

    thread = ServerThread(serve, runner.cleanup, name="test-backend")
    thread.start()
    try:
        yield urls[0]
    finally:
        thread.stop()


@pytest.fixture
def thread_hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of what the sidecar sends to a worker thread each time it does (``asyncio.to_thread`` in
    ``serve/app.py``, run inline here)."""
    hops: list[int] = []

    async def to_thread(function: Any, *args: Any) -> Any:
        hops.append(len(args[0]))
        return function(*args)

    monkeypatch.setattr("prefixroute.adapters.serve.app.asyncio.to_thread", to_thread)
    return hops
