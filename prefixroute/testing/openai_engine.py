"""A fake vLLM OpenAI-compatible HTTP engine on loopback, for tests and demos of gateways (needs ``[proxy]``).

It serves what ``vllm serve`` serves, in vLLM's formats: ``POST /v1/completions`` and ``/v1/chat/completions``
(streamed as Server-Sent Events, chunk by chunk, ending in ``data: [DONE]``, or one JSON body with ``usage``
including ``prompt_tokens_details.cached_tokens`` as vLLM with ``--enable-prompt-tokens-details`` reports it: null
when no prompt token came from the cache), ``GET /v1/models``, ``/metrics`` (vLLM's Prometheus names) and
``/health``. Behind them is a real block-level prefix cache (:class:`~prefixroute.testing.FakeBlockCache`): a
request hits the longest cached prefix of full blocks and its time to first token grows with its *uncached*
tokens, so a router that keeps prefixes together measurably wins. Prompts are token ids or text (a completion's
``prompt`` may be a batch of either, and ``n`` asks for that many answers per prompt, as vLLM takes them); text is
split on whitespace, each word one token (or pass ``tokenizer=``). A route's path with trailing slashes is
Starlette's 307 to the route, as vLLM's app answers it. A request whose client disconnects is aborted at once,
queued or running, as vLLM aborts it.

::

    with OpenAIEngine(prefill_per_token_s=50e-6, token_delay_s=0.002) as engine:
        engine.url                  # http://127.0.0.1:PORT
        engine.fail_next(2)         # the next two requests get HTTP 500
        engine.refuse()             # stop listening (and drop open connections); engine.accept() listens again
        engine.stall(after_tokens=1)  # requests hang after one streamed token until engine.resume()

From the command line, N engines (at most :data:`MAX_ENGINES`) on consecutive ports; Ctrl-C or SIGTERM closes them
and exits 0::

    python -m prefixroute.testing.openai_engine --count 3 --base-port 8100
    prefixroute fake-engines --count 3 --base-port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import random
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

from aiohttp import web

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.adapters._listening import close_listener
from prefixroute.adapters._slashes import request_redirect
from prefixroute.adapters.serve.contract import (
    UNSUPPORTED_MEDIA_TYPE,
    is_batch,
    is_json_media_type,
    request_int,
    request_ints,
)
from prefixroute.adapters.threaded import ServerThread
from prefixroute.adapters.urls import host_port, listen_host
from prefixroute.errors import ConfigurationError, InvalidTypeError, StateError
from prefixroute.testing._http import (
    JSON,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    PREFLIGHT_BODY,
    SSE,
    cors_headers,
    is_preflight,
    json_body,
    preflight_headers,
)
from prefixroute.testing._names import check_served_names, model_list
from prefixroute.testing._requests import (
    Invalid,
    Refused,
    check_types,
    error_body,
    json_object,
    lax_int,
    model_not_found,
    read_max_tokens,
)
from prefixroute.testing.fake_cache import FakeBlockCache
from prefixroute.vllm.metrics import TTFT_BUCKETS

__all__ = ["MAX_ENGINES", "EngineStats", "OpenAIEngine", "main", "register", "whitespace_tokens"]

MAX_ENGINES = 256
"""The most engines ``fake-engines --count`` starts: one process serves them all, each with its listener, its
clients' connections and its cache, so more would run out of file descriptors (1,024 by default) long before ports,
and a larger count is a typo, not a test."""

_SSE_HEADERS = MappingProxyType({"Content-Type": SSE})
_POLL_S = 0.005  # how often a stalled request looks for resume() or its client leaving
_MAX_BODY_BYTES = 256 * 2**20  # the largest request body served (the proxy in front of it takes 64 MiB by default)
_MAX_CHOICES = 1 << 16  # the most answers per request (prompts times ``n``) served


def whitespace_tokens(text: str) -> list[int]:
    """The fake's tokenizer: one token per whitespace-separated word, its id a CRC32 of the word. O(len(text))."""
    return [zlib.crc32(word.encode("utf-8", "surrogatepass")) for word in text.split()]


# The keys that make a content part without "type" one of vLLM's simple media forms (chat_utils'
# _parse_chat_message_content_mm_part); "input_audio" counts only when it is not null.
_TYPELESS_MEDIA = ("image_url", "image_pil", "image_embeds", "audio_embeds", "audio_url", "video_url")


def render_chat(messages: object) -> str:
    """The fake's chat template: ``<|role|> content`` per message, then ``<|assistant|>``.

    A null or absent ``content`` (an assistant's tool calls) renders empty, as vLLM reads it; a content part may be a
    plain string (its text) or an object; a text part without ``text`` (or null) is skipped, and parts that are not
    text (images and the like, also vLLM's simple forms without ``type``: ``{"image_url": ...}``) render nothing.
    Any string ``role`` is rendered, ``""`` too: vLLM's message type takes any str and leaves roles to the template.

    Raises:
        ValueError: a message is not ``{"role": str, "content": str | [str | {"type": "text", "text": str}, ...] |
            null}``;
            a content part without a string ``type`` that is no media part either, or of a type vLLM does not
            know, in vLLM's words (``Missing 'type' field in multimodal part.``, ``Invalid 'type' field in
            multimodal part.``, ``Unsupported chat content part type: ...``).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    parts = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string 'role'")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(part, (dict, str)) for part in content):
                raise ValueError("a message's 'content' parts must be objects or strings")
            texts = [text for part in content if (text := _part_text(part)) is not None]
            content = " ".join(texts)
        if not isinstance(content, str):
            raise ValueError("a message's 'content' must be a string or a list of text parts")
        parts.append(f"<|{message['role']}|> {content}")
    return "\n".join(parts) + "\n<|assistant|>"


# The content-part types vLLM's chat_utils parses (MM_PARSER_MAP): those it renders as text, each with the key its
# text is read from (a tool reference renders its name), and the media ones, which a text template renders as none.
_TEXT_PARTS = MappingProxyType({"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking", "tool_reference": "name"})  # fmt: skip
_MEDIA_PARTS = ("image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
                "video_url", "video_embeds", "prompt_embeds")  # fmt: skip
_SUPPORTED_PARTS = ", ".join(sorted((*_TEXT_PARTS, *_MEDIA_PARTS)))


def _part_text(part: dict[str, Any] | str) -> str | None:
    """The text a content part renders, as chat_utils' _parse_chat_message_content_part reads it: a plain string is
    its own text, a text part (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``,
    ``tool_reference``) its text, and one whose text is absent or null is skipped (None), as are images and the
    like. O(1).

    Raises:
        ValueError: a part vLLM refuses (see :func:`_check_part_type`), or a text that is no string; a type vLLM has
            no parser for, in its words (``Unsupported chat content part type: ...``), with ``param`` "type".
    """
    if isinstance(part, str):
        return part
    _check_part_type(part)
    kind = part.get("type")
    if kind is None or kind in _MEDIA_PARTS:
        return None  # images and the like (typeless media forms too): no text
    key = _TEXT_PARTS.get(kind)
    if key is None:  # VLLMValidationError's str() appends its parameter and value
        raise Refused(
            f"Unsupported chat content part type: {kind!r}. Supported types: {_SUPPORTED_PARTS}. "
            f"(parameter=type, value={kind})",
            param="type",
        )
    text = part.get(key)
    if text is not None and not isinstance(text, str):
        raise ValueError(f"a {kind} part's {key!r} must be a string")
    return text


def _check_part_type(part: dict[str, Any]) -> None:
    """Refuse a content part as vLLM does: one without ``type`` unless it is a simple media form, or whose ``type``
    is no string. O(1).

    Raises:
        ValueError: in vLLM's words (it answers 400).
    """
    kind = part.get("type")
    if kind is None:
        if not any(key in part for key in _TYPELESS_MEDIA) and part.get("input_audio") is None:
            raise ValueError("Missing 'type' field in multimodal part.")
    elif not isinstance(kind, str):
        raise ValueError("Invalid 'type' field in multimodal part.")


def _stream_options(value: object) -> None:
    """Refuse ``stream_options`` as vLLM's pydantic model does: null, or an object whose ``include_usage`` and
    ``continuous_usage_stats`` are lax booleans (or null). O(1).

    Raises:
        Invalid: anything else (vLLM's pydantic model answers 400, ``param`` the field's location).
    """
    if value is None:
        return
    if not isinstance(value, dict):
        raise Invalid(
            f"stream_options: Input should be a valid dictionary or instance of StreamOptions, not {shown(value)}",
            param="body.stream_options",
        )
    for key in ("include_usage", "continuous_usage_stats"):
        try:
            _stream_flag(value.get(key))
        except ValueError:
            raise Invalid(
                f"stream_options.{key}: Input should be a valid boolean, not {shown(value[key])}",
                param=f"body.stream_options.{key}",
            ) from None


def _choices(body: dict[str, Any], prompts: int) -> int:
    """``n``, the answers per prompt, as vLLM reads it: absent or null 1, else a lax int of at least 1 (here with
    at most :data:`_MAX_CHOICES` answers in all, so that no request makes the fake build an unbounded answer).

    Raises:
        ValueError: anything else (vLLM answers 400).
    """
    value = body.get("n")
    n = 1 if value is None else lax_int("n", value)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    if n * prompts > _MAX_CHOICES:
        raise ValueError(
            f"the fake engine answers at most {_MAX_CHOICES} choices a request, not {prompts} prompts times n={n}"
        )
    return n


_FLAGS = MappingProxyType({"1": True, "on": True, "t": True, "true": True, "y": True, "yes": True,
          "0": False, "off": False, "f": False, "false": False, "n": False, "no": False})  # fmt: skip


def _stream_flag(value: object) -> bool:
    """``stream`` as vLLM reads it (pydantic's lax bool): JSON true/false or null, 0/1, or "true"/"no"-like text.

    Raises:
        Invalid: any other value (vLLM's pydantic model answers 400, ``param`` "body.stream").
    """
    if value is None or isinstance(value, bool):
        return bool(value)
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _FLAGS:
        return _FLAGS[value.lower()]
    raise Invalid(f"'stream' must be a boolean, not {value!r}", param="body.stream")


def _hook_count(value: object, option: str) -> int:
    """``value`` as a plain int if it is an int in [0, 2**31] (numpy's too, not a bool); else a ConfigurationError."""
    number = as_int(value)
    if number is None or not 0 <= number <= 2**31:
        raise ConfigurationError(f"{option} must be an int in [0, 2**31], not {shown(value)}")
    return number


def _delay(option: str, value: object) -> float:
    """``value`` as a plain float if it is a finite number of seconds >= 0; else a ConfigurationError."""
    seconds = as_float(value)
    if seconds is None or seconds < 0:  # an infinite delay would hold every request forever
        raise ConfigurationError(f"{option} must be a finite, non-negative number of seconds, not {shown(value)}")
    return seconds


@dataclass(frozen=True)
class EngineStats:
    """What an :class:`OpenAIEngine` has done so far (a snapshot)."""

    requests: int
    """Completion requests received (including failed and bad ones)."""
    completed: int
    """Requests answered in full."""
    failed: int
    """Requests answered with an injected error (:meth:`OpenAIEngine.fail_next`)."""
    disconnected: int
    """Requests whose client went away before the answer was complete: each aborted at once, queued, in prefill or
    generating (its slot and blocks freed), as vLLM aborts it."""
    running: int
    """Requests being answered now."""
    waiting: int
    """Requests queued behind ``max_running``."""
    prompt_tokens: int
    """Prompt tokens of admitted requests."""
    cached_tokens: int
    """Of those, tokens served from the prefix cache."""
    simulated_prefill_s: float = 0.0
    """Prefill the engine simulated for admitted requests, seconds: ``prefill_s`` plus ``prefill_per_token_s`` per
    uncached prompt token, each request's slept before its first token (a stall not counted). Its record, not a
    clock's: a test asserts on it, and on :attr:`cached_tokens`, rather than on how long a request took."""


class OpenAIEngine:
    """One fake engine (see the module docstring). Every option is keyword-only.

    Args:
        model: the model name it serves (``/v1/models``; a request naming another model gets vLLM's 404, ``param``
            "model"; one that names none, null or ``""``, is served by the base model, as vLLM serves it).
        lora_adapters: LoRA adapter names it also serves, as vLLM's ``--lora-modules`` do: listed in
            ``/v1/models`` with ``model`` as their ``parent``, and cached apart from the base model and each other.
        block_size: tokens per KV block of its prefix cache.
        num_blocks: KV blocks; a request that does not fit evicts free cached blocks, least recently freed first.
        prefill_s: time to first token of a fully cached prompt, seconds.
        prefill_per_token_s: added time to first token per uncached prompt token.
        token_delay_s: time between generated tokens.
        max_tokens: tokens generated when a request names no ``max_tokens``.
        max_running: requests generated at once (vLLM's ``max_num_seqs``); others wait (None: no limit).
        tokenizer: text to token ids (default :func:`whitespace_tokens`).
        seed: seeds the cache's block hashes and the response ids.
        clock: seconds since the epoch, for each response's ``created`` (default :func:`time.time`).
        host, port: where to listen (port 0: a free one the OS picks; kept across :meth:`refuse`/:meth:`accept`).

    Raises:
        ConfigurationError: a ``model`` or ``lora_adapters`` that :func:`check_served_names` refuses (no str, no
            collection of str, blank, a lone surrogate, an adapter twice or named as the model), a ``host`` that is
            not a str, a ``seed`` that is not an int, a delay that is negative or infinite, a ``max_tokens``,
            ``max_running`` or ``port`` out of range: whatever its type, an option's value it cannot use.
        TypeError: ``clock`` or ``tokenizer`` is not a callable.

    :meth:`start` serves on a thread of its own (its own event loop), so synchronous and asynchronous tests alike
    can use it; :meth:`serve` runs it on the caller's loop instead. The test hooks are thread-safe.
    """

    def __init__(
        self,
        *,
        model: str = "fake-model",
        lora_adapters: Sequence[str] = (),
        block_size: int = 16,
        num_blocks: int = 4096,
        prefill_s: float = 0.0,
        prefill_per_token_s: float = 0.0,
        token_delay_s: float = 0.0,
        max_tokens: int = 16,
        max_running: int | None = None,
        tokenizer: Callable[[str], list[int]] = whitespace_tokens,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        for option, function in (("clock", clock), ("tokenizer", tokenizer)):
            if not callable(function):
                raise InvalidTypeError(f"{option} must be a callable, not {shown(function)}")
        if not isinstance(host, str):
            raise ConfigurationError(f"host must be a str, not {shown(host)}")
        prefill_s = _delay("prefill_s", prefill_s)
        prefill_per_token_s = _delay("prefill_per_token_s", prefill_per_token_s)
        token_delay_s = _delay("token_delay_s", token_delay_s)
        tokens = as_int(max_tokens)
        running = None if max_running is None else as_int(max_running)
        if tokens is None or tokens < 1 or (max_running is not None and (running is None or running < 1)):
            raise ConfigurationError(
                f"max_tokens and max_running must be positive ints (max_running also None), not "
                f"{shown(max_tokens)} and {shown(max_running)}"
            )
        listen_port = as_int(port)
        if listen_port is None or not 0 <= listen_port <= 65535:
            raise ConfigurationError(f"port must be an int in [0, 65535] (0: any free), not {shown(port)}")
        seed_int = as_int(seed)
        if seed_int is None:
            raise ConfigurationError(f"seed must be an int, not {shown(seed)}")
        max_tokens, max_running, port = tokens, running, listen_port
        self.model, self.lora_adapters = check_served_names(model, lora_adapters)
        self.cache = FakeBlockCache(block_size=block_size, num_blocks=num_blocks, rng=random.Random(seed_int))
        self._ids = random.Random(seed_int)  # response ids: same seed, same answers (not the process-wide RNG)
        self._clock = clock
        self.prefill_s = prefill_s
        self.prefill_per_token_s = prefill_per_token_s
        self.token_delay_s = token_delay_s
        self.max_tokens = max_tokens
        self._tokenizer = tokenizer
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("requests", "completed", "failed", "disconnected", "prompt", "cached"), 0)
        self._running = 0
        self._waiting = 0
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # per bucket (not cumulative), the last one +Inf
        self._ttft_sum = 0.0
        self._prefill_total = 0.0  # seconds of prefill simulated (EngineStats.simulated_prefill_s)
        self._max_running = max_running
        self._fail: tuple[int, int] = (0, 500)
        self._stall_after: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._slots: asyncio.Semaphore | None = None
        self._serving: ServerThread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port``, once started (an IPv6 host in brackets: ``http://[::1]:PORT``)."""
        if not self._port:
            raise StateError("the engine is not started: call start() (or await serve()) first")
        return f"http://{host_port(self._host, self._port)}"

    async def serve(self) -> None:
        """Start listening on the running event loop and return (stop with :meth:`aclose`).

        Raises:
            StateError: the engine is serving already (:meth:`aclose` it first).
        """
        self._refuse_second_start(self._runner is not None)
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self._max_running) if self._max_running else None
        # vLLM caps no request body; aiohttp's default of 1 MiB would refuse a long prompt (100k token ids)
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[_as_vllms_app])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        # FastAPI serves a GET route no HEAD (aiohttp's would); vLLM's Prometheus app is mounted under /metrics, for
        # every path that starts so and every method
        app.router.add_get("/v1/models", self._models, allow_head=False)
        app.router.add_route("*", "/metrics{tail:.*}", self._metrics)
        app.router.add_get("/health", self._health, allow_head=False)
        app.on_response_prepare.append(_cors_header)
        # vLLM aborts a request the moment its client disconnects (with_cancellation, and a StreamingResponse's own
        # listener), in prefill or queued too, freeing its slot and blocks: aiohttp cancels the handler so.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        try:
            await self._runner.setup()
            await self._listen()
        except BaseException:  # e.g. the port is taken: not serving, so a later start() may try again
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop serving (open connections are dropped). Idempotent."""
        if self._runner is not None:
            # Drop them first, as refuse() does: aiohttp's cleanup alone is a graceful shutdown, which waits for the
            # requests in progress (a stalled one for its 60 s), and a request sent meanwhile on a kept-alive
            # connection is neither served nor refused, so its client hangs as long.
            await self._unlisten()
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def start(self) -> OpenAIEngine:
        """Serve on a thread of its own; return self once listening.

        Raises:
            StateError: the engine is serving already (:meth:`stop` it first).
        """
        self._refuse_second_start(self._serving is not None or self._runner is not None)
        serving = ServerThread(self.serve, self.aclose, name="fake-openai-engine")
        serving.start()  # raises what serve() raised
        self._serving = serving
        return self

    def _refuse_second_start(self, serving: bool) -> None:
        """A second server would take the first one's place, and then nothing could stop the first."""
        if serving:
            raise StateError("the engine is serving already: stop it (stop() or aclose()) first")

    def stop(self) -> None:
        """Stop the thread :meth:`start` started. Idempotent, also from several threads at once."""
        serving = self._serving
        if serving is not None:
            serving.stop()  # locked and idempotent: a concurrent stop() waits for this one
            self._serving = None

    def __enter__(self) -> OpenAIEngine:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- test hooks ------------------------------------------------------------------------------------------------

    def fail_next(self, count: int = 1, *, status: int = 500) -> None:
        """Answer the next ``count`` completion requests with HTTP ``status`` and an OpenAI-style error body.

        Raises:
            ConfigurationError: ``count`` is not an int in [0, 2**31], ``status`` not an HTTP error status (an int
                in [400, 599]); checked here, not by the request that would fail, and nothing changes.
        """
        times = _hook_count(count, "count")
        code = as_int(status)
        if code is None or not 400 <= code <= 599:
            raise ConfigurationError(f"status must be an HTTP error status, an int in [400, 599], not {shown(status)}")
        with self._lock:
            self._fail = (times, code)

    def stall(self, *, after_tokens: int = 0) -> None:
        """Make requests hang once they have streamed ``after_tokens`` tokens (0: before any answer), until
        :meth:`resume`. Requests already past that point are not held.

        Raises:
            ConfigurationError: ``after_tokens`` is not an int in [0, 2**31] (nothing changes).
        """
        tokens = _hook_count(after_tokens, "after_tokens")
        with self._lock:
            self._stall_after = tokens

    def resume(self) -> None:
        """Let stalled requests go on."""
        with self._lock:
            self._stall_after = None

    def refuse(self) -> None:
        """Stop listening and drop every open connection: new connections are refused, as from a dead engine.

        Raises:
            StateError: the engine is not serving (never started, or stopped).
        """
        self._call(self._unlisten())

    def accept(self) -> None:
        """Listen again, on the same port, after :meth:`refuse`.

        Raises:
            StateError: the engine is not serving (never started, or stopped).
        """
        self._call(self._listen())

    def stats(self) -> EngineStats:
        """Return what the engine has done so far."""
        with self._lock:
            c = self._counts
            return EngineStats(c["requests"], c["completed"], c["failed"], c["disconnected"], self._running,
                               self._waiting, c["prompt"], c["cached"], self._prefill_total)  # fmt: skip

    def metrics_text(self) -> str:
        """The Prometheus text ``/metrics`` serves, with vLLM's metric names."""
        labels = f'{{engine="0",model_name="{self.model}"}}'
        with self._lock:
            figures = [
                ("gauge", "vllm:num_requests_running", self._running),
                ("gauge", "vllm:num_requests_waiting", self._waiting),
                ("gauge", "vllm:kv_cache_usage_perc", self.cache.usage()),
                ("counter", "vllm:prefix_cache_queries", self.cache.queries),
                ("counter", "vllm:prefix_cache_hits", self.cache.hits),
            ]
        lines = []
        for kind, name, value in figures:
            suffix = "_total" if kind == "counter" else ""
            lines += [f"# TYPE {name}{suffix} {kind}", f"{name}{suffix}{labels} {float(value)}"]
        lines += ["# TYPE vllm:time_to_first_token_seconds histogram"]
        with self._lock:
            counts, total = list(self._ttft_counts), self._ttft_sum
        cumulative = 0
        for bound, count in zip((*map(str, TTFT_BUCKETS), "+Inf"), counts, strict=True):
            cumulative += count
            bucket = f'engine="0",le="{bound}",model_name="{self.model}"'
            lines.append(f"vllm:time_to_first_token_seconds_bucket{{{bucket}}} {float(cumulative)}")
        lines += [f"vllm:time_to_first_token_seconds_count{labels} {float(cumulative)}",
                  f"vllm:time_to_first_token_seconds_sum{labels} {total}"]  # fmt: skip
        cache = self.cache
        info = (f'block_size="{cache.block_size}",enable_prefix_caching="True",engine="0",'
                f'num_gpu_blocks="{cache.num_blocks}"')  # fmt: skip
        lines += ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1.0"]
        return "\n".join(lines) + "\n"

    # -- serving ---------------------------------------------------------------------------------------------------

    def _call(self, coroutine: Any) -> None:
        if self._loop is None or self._runner is None:  # never started, or stopped (its loop may be closed)
            coroutine.close()
            raise StateError("the engine is not started: call start() (or await serve()) first")
        if self._serving is not None and not self._serving.is_current():
            asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)
        else:  # on the engine's own loop (serve()): schedule it
            self._loop.create_task(coroutine)

    async def _listen(self) -> None:
        assert self._runner is not None and self._runner.server is not None
        if self._listener is not None:
            return
        # asyncio's server itself (aiohttp's TCPSite hides it), which _unlisten() closes with close_listener()
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self._runner.server, self._host, self._port, reuse_address=True)
        self._port = self._port or int(self._listener.sockets[0].getsockname()[1])

    async def _unlisten(self) -> None:
        if self._listener is None or self._runner is None:
            return
        listener, self._listener = self._listener, None
        # Closed so, every connection it accepted, however late, is registered with aiohttp: all are dropped below.
        await close_listener(listener)
        server = self._runner.server if self._runner is not None else None
        for handler in server.connections if server is not None else ():
            if handler.transport is not None:
                handler.transport.abort()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        with self._lock:  # the permission ids: the engine's seeded RNG, as the response ids
            ids = [f"modelperm-{self._ids.getrandbits(128):032x}" for _ in range(1 + len(self.lora_adapters))]
        listing = model_list(self.model, self.lora_adapters, created=int(self._clock()), permission_ids=iter(ids))
        return _json(listing)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain", charset="utf-8")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        with self._lock:
            self._counts["requests"] += 1
            failures, status = self._fail
            if failures:
                self._fail = (failures - 1, status)
                self._counts["failed"] += 1
        if failures:
            return _error(status, "injected failure (OpenAIEngine.fail_next)", "InternalServerError")
        try:
            if not is_json_media_type(request.headers.get("Content-Type")):  # vLLM's validate_json_request
                raise Invalid(UNSUPPORTED_MEDIA_TYPE, param=None)  # a RequestValidationError naming no field
            body = json_object(await request.read())
            check_types(body)
            prompts = self._prompts(body, chat=chat)
            if body.get("stream_options") and not body.get("stream"):  # vLLM's model validator, on the values as sent
                raise Invalid("Stream options can only be defined when `stream=True`.", param="stream_options")
            _stream_options(body.get("stream_options"))
            _stream_flag(body.get("stream"))
            n = _choices(body, len(prompts))
            name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            limit = body.get(name)  # vLLM reads max_completion_tokens before max_tokens
            max_tokens = read_max_tokens(limit, self.max_tokens, max(map(len, prompts)), name=name)
        except (ValueError, TypeError) as exc:
            return _json(error_body(exc), status=400)
        missing = model_not_found(body.get("model"), (self.model, *self.lora_adapters))
        if missing is not None:
            return _json(missing, status=404)
        if self._slots is not None:
            with self._lock:
                self._waiting += 1
            try:
                await self._slots.acquire()
            except asyncio.CancelledError:  # its client left while it queued: aborted, never scheduled
                with self._lock:
                    self._counts["disconnected"] += 1
                raise
            finally:
                with self._lock:
                    self._waiting -= 1
        try:
            return await self._answer(request, body, prompts, n, max_tokens, chat=chat)
        except _ClientGone:  # counted; nobody is left to answer
            return web.Response(status=499)
        finally:
            if self._slots is not None:
                self._slots.release()

    def _prompts(self, body: dict[str, Any], *, chat: bool) -> list[list[int]]:
        """The request's prompts as token ids: a chat's one, or a completion's ``prompt`` as vLLM takes it (a text,
        token ids, or a batch: a list of texts or of token-id lists)."""
        if chat:
            return [self._tokenizer(render_chat(body.get("messages")))]
        prompt = body.get("prompt")
        if prompt is None or prompt == "":  # vLLM's model validator: a ValueError, located at the body
            raise Invalid("Either prompt or prompt_embeds must be provided and non-empty.", param="body")
        batch = prompt if isinstance(prompt, list) and prompt and is_batch(prompt) else [prompt]
        texts = all(isinstance(one, str) for one in batch)  # a batch is all texts or all token-id lists
        prompts = []
        for one in batch:
            if texts and isinstance(one, str):
                prompts.append(self._tokenizer(one))
            elif isinstance(one, list) and one and (ids := _token_ids(one)) is not None:
                prompts.append(ids)
            else:
                message = "'prompt' must be a string, a non-empty list of token ids, or a list of strings or of those"
                if isinstance(one, list) and all(type(t) is int for t in one):  # pydantic's type: a later 400
                    raise ValueError(message)
                raise Invalid(message, param=_prompt_param(prompt))
        return prompts

    async def _answer(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        lora_name = body["model"] if body.get("model") in self.lora_adapters else None
        with self._lock:
            held = [self.cache.allocate(prompt, lora_name=lora_name) for prompt in prompts]
            self.cache.take_events()  # this engine publishes no KV events: kept, they grew for as long as it served
            prompt_tokens = sum(one.prompt_tokens for one in held)
            cached_tokens = sum(one.cached_tokens for one in held)
            self._running += 1
            self._counts["prompt"] += prompt_tokens
            self._counts["cached"] += cached_tokens
            prefill = self.prefill_s + self.prefill_per_token_s * (prompt_tokens - cached_tokens)
            self._prefill_total += prefill
        stream = _stream_flag(body.get("stream"))
        # vLLM's _base_request_id: the client's X-Request-Id, else the body's request_id, else a random one.
        request_id = request.headers.get("X-Request-Id")
        if request_id is None and "request_id" in body:  # a str: anything else was refused
            request_id = body["request_id"]
        if request_id is None:
            with self._lock:
                request_id = f"{self._ids.getrandbits(128):032x}"  # as vLLM's random_uuid(), uuid4().hex, seeded
        # The answer names the model asked for, an adapter's own name too, as vLLM's does.
        chunks = _Chunks(lora_name or self.model, chat=chat, request_id=request_id, created=int(self._clock()))
        choices = range(len(prompts) * n)  # as vLLM numbers them: prompt p's i-th answer is p * n + i
        completion_tokens = max_tokens * len(choices)
        # As vLLM started with --enable-prompt-tokens-details reports them: the details only when some prompt
        # tokens came from the cache (else null, and left out of a stream's usage chunk).
        details = {"cached_tokens": cached_tokens} if cached_tokens else None
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}  # fmt: skip
        response: web.StreamResponse | None = None
        finished = False
        started = time.perf_counter()
        try:
            if stream:  # vLLM (Starlette) sends the headers at once, the first chunk after prefill
                response = web.StreamResponse(headers=_SSE_HEADERS)
                await response.prepare(request)
            await self._pause(request, sent=0)
            await asyncio.sleep(prefill)
            self._observe_ttft(time.perf_counter() - started)
            if response is None:
                for sent in range(1, max_tokens):
                    await self._pause(request, sent=sent)
                    await asyncio.sleep(self.token_delay_s)
                finished = True
                return _json(chunks.whole(max_tokens, choices, usage))
            options: dict[str, Any] | None = body.get("stream_options")  # null or an object: the rest was refused
            include_usage = continuous = False
            if options is not None:  # vLLM's should_include_usage: usage by default, the usage so far only with it
                include_usage = _stream_flag(options.get("include_usage", True))
                continuous = include_usage and _stream_flag(options.get("continuous_usage_stats"))
            prompt_of = [held[index // n].prompt_tokens if continuous else None for index in choices]
            if chat:
                await response.write(
                    b"".join(chunks.sse(chunks.role(index, prompt_tokens=prompt_of[index])) for index in choices)
                )
            for sent in range(max_tokens):
                if sent:
                    await self._pause(request, sent=sent)
                    await asyncio.sleep(self.token_delay_s)
                last = sent == max_tokens - 1
                await response.write(
                    b"".join(
                        chunks.sse(chunks.token(sent, index, last=last, prompt_tokens=prompt_of[index]))
                        for index in choices
                    )
                )
            if include_usage:
                await response.write(chunks.sse(chunks.usage(usage)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            finished = True
            return response
        except (ConnectionError, asyncio.CancelledError, _ClientGone) as exc:
            if isinstance(request.transport, asyncio.Transport):
                request.transport.abort()
            if isinstance(exc, ConnectionError):  # a write to a client that left (e.g. during prefill): counted below
                raise _ClientGone from None
            raise
        finally:
            with self._lock:
                for one in held:
                    self.cache.free(one)
                self._running -= 1
                self._counts["completed" if finished else "disconnected"] += 1

    def _observe_ttft(self, seconds: float) -> None:
        """Count one time to first token in the histogram ``/metrics`` serves (as vLLM does when prefill ends)."""
        bucket = bisect.bisect_left(TTFT_BUCKETS, seconds)  # the first bound >= seconds; past the last: +Inf
        with self._lock:
            self._ttft_counts[bucket] += 1
            self._ttft_sum += seconds

    async def _pause(self, request: web.Request, *, sent: int) -> None:
        """Hold a request while stalled at ``sent`` tokens; raise when its client has gone."""
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                raise _ClientGone
            with self._lock:
                stalled = self._stall_after == sent
            if not stalled:
                return
            await asyncio.sleep(_POLL_S)


@web.middleware
async def _as_vllms_app(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer as vLLM's FastAPI app does what no route serves: CORSMiddleware's 200 to a preflight on any path,
    Starlette's empty 307 to a route's path asked with trailing slashes, FastAPI's JSON 404 and 405 (with ``Allow``)
    where aiohttp would answer text."""
    if is_preflight(request.method, request.headers):
        requested = request.headers.get("Access-Control-Request-Headers")
        headers = preflight_headers(requested)
        return web.Response(body=PREFLIGHT_BODY, content_type="text/plain", charset="utf-8", headers=headers)
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return web.Response(status=405, body=METHOD_NOT_ALLOWED, content_type=JSON,
                            headers={"Allow": allowed})  # fmt: skip
    except web.HTTPNotFound:
        location = request_redirect(request)  # Starlette's redirect_slashes: a route's path with trailing slashes
        if location is not None:
            return web.Response(status=307, headers={"Location": location})
        return web.Response(status=404, body=NOT_FOUND, content_type=JSON)
    return response


async def _cors_header(request: web.Request, response: web.StreamResponse) -> None:
    """Add the header CORSMiddleware adds to an answer to a request with an ``Origin`` (a stream's too)."""
    response.headers.update(cors_headers(request.headers))


def _token_ids(prompt: list[Any]) -> list[int] | None:
    """``prompt`` as the token ids vLLM's request model (pydantic, lax) reads from a ``list[int]``
    (:func:`request_ints`: ``true``, ``2.0`` and ``"3"`` are ints), each in [0, 2**32); None otherwise. O(n)."""
    ids = request_ints(prompt)
    return ids if ids is not None and all(0 <= token < 2**32 for token in ids) else None


def _prompt_param(prompt: object) -> str:
    """Where pydantic locates the first error of a ``prompt`` that none of vLLM's types (``list[int] |
    list[list[int]] | str | list[str]``) takes, as vLLM's handler cleans it: the list[int] branch's first item that
    pydantic reads as no int (``body.prompt.0``; ``true`` and ``2.0`` are ints to it), else the prompt
    (``body.prompt``). O(len(prompt))."""
    if isinstance(prompt, list):
        for index, item in enumerate(prompt):
            if request_int(item) is None:
                return f"body.prompt.{index}"
    return "body.prompt"


class _ClientGone(Exception):
    """The client closed its connection while its request was being answered."""


class _Chunks:
    """vLLM's response bodies for one request: stream chunks and the whole answer."""

    def __init__(self, model: str, *, chat: bool, request_id: str, created: int) -> None:
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}  # fmt: skip

    @staticmethod
    def sse(data: dict[str, Any]) -> bytes:
        return b"data: " + json_body(data) + b"\n\n"  # as pydantic's model_dump_json(): compact, UTF-8

    def role(self, index: int, *, prompt_tokens: int | None = None) -> dict[str, Any]:
        """A chat choice's first chunk; ``prompt_tokens`` (continuous usage stats): with the usage so far, none
        generated."""
        delta = {"role": "assistant", "content": ""}
        chunk = {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
        return chunk if prompt_tokens is None else {**chunk, "usage": self._so_far(prompt_tokens, 0)}

    def token(self, i: int, index: int, *, last: bool, prompt_tokens: int | None = None) -> dict[str, Any]:
        """Choice ``index``'s token ``i``; ``prompt_tokens`` (continuous usage stats): with the usage so far, of the
        prompt that choice answers."""
        reason = "length" if last else None
        usage = None if prompt_tokens is None else self._so_far(prompt_tokens, i + 1)
        if self.chat:  # vLLM dumps a chat chunk without its unset fields: stop_reason is set on the last one only
            choice = {"index": index, "delta": {"content": f" t{i}"}, "logprobs": None, "finish_reason": reason}
            if last:
                choice["stop_reason"] = None
            chunk = {**self.head, "choices": [choice]}
            return chunk if usage is None else {**chunk, "usage": usage}
        # and a completion chunk whole: its usage null unless continuous, and then with null details
        choice = {"index": index, "text": f" t{i}", "logprobs": None, "finish_reason": reason, "stop_reason": None}
        if usage is not None:
            usage["prompt_tokens_details"] = None
        return {**self.head, "choices": [choice], "usage": usage}

    @staticmethod
    def _so_far(prompt_tokens: int, generated: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        # vLLM dumps the usage chunk without its nulls (exclude_none=True)
        return {**self.head, "choices": [], "usage": {key: value for key, value in usage.items() if value is not None}}

    def whole(self, tokens: int, indices: range, usage: dict[str, Any]) -> dict[str, Any]:
        text = "".join(f" t{i}" for i in range(tokens))
        choices: list[dict[str, Any]] = []
        for index in indices:
            if self.chat:
                message = {"role": "assistant", "content": text, "tool_calls": []}
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                choice = {"index": index, "text": text, "prompt_logprobs": None}
            choice.update(logprobs=None, finish_reason="length", stop_reason=None)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": kind, "choices": choices, "usage": usage}


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return _json(body, status=status)


def _json(content: Any, *, status: int = 200) -> web.Response:
    """``content`` as vLLM's JSONResponse answers it (compact, ``application/json`` with no charset)."""
    return web.Response(body=json_body(content), status=status, content_type=JSON)


# -- the command line ----------------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add the ``fake-engines`` subcommand to the ``prefixroute`` CLI."""
    parser = subparsers.add_parser(
        "fake-engines",
        help="serve fake vLLM OpenAI-compatible engines on loopback (for demos and tests)",
        description="Serve --count fake vLLM engines (OpenAI completions and chat, /v1/models, /metrics, a "
        "block-level prefix cache each) on consecutive ports from --base-port, until interrupted (Ctrl-C or "
        "SIGTERM: the engines close, exit status 0).",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fake-engines`` (also ``python -m prefixroute.testing.openai_engine``)."""
    parser.add_argument("--count", type=int, default=3, help=f"engines to start, 1 to {MAX_ENGINES} (default 3)")
    parser.add_argument(
        "--base-port", type=int, default=8100, help="port of the first; the others follow (default 8100)"
    )
    parser.add_argument("--host", type=listen_host, default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--model", default="fake-model", help="the model name served (default fake-model)")
    parser.add_argument("--lora-adapters", nargs="+", default=(), metavar="NAME",
                        help="LoRA adapter names also served (cached apart from the base model)")  # fmt: skip
    parser.add_argument("--prefill-us-per-token", type=float, default=50.0,
                        help="added TTFT per uncached prompt token, microseconds (default 50)")  # fmt: skip
    parser.add_argument("--token-delay-ms", type=float, default=5.0, help="time between tokens (default 5 ms)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens when a request names none (16)")


def run(args: argparse.Namespace) -> int:
    """Serve ``args.count`` engines until SIGINT or SIGTERM; return the exit status (0 once they are closed)."""
    if not 1 <= args.count <= MAX_ENGINES:
        raise ConfigurationError(f"--count must be a whole number in 1..{MAX_ENGINES}, not {args.count}")
    if not 0 < args.base_port <= 65536 - args.count:  # the last engine on port 65535 at most
        raise ConfigurationError(
            f"--base-port must be a port with room for --count engines (1..{65536 - args.count}), not {args.base_port}"
        )
    if not 1 <= args.max_tokens <= 1_000_000:
        raise ConfigurationError(f"--max-tokens must be in 1..1000000, not {shown(args.max_tokens)}")
    check_served_names(args.model, args.lora_adapters, model_option="--model", adapters_option="--lora-adapters")
    # A fake engine that takes longer than a second a prompt token or a minute a token would hold its clients
    # for good (1e300 slept forever): bounded, so a typo is an error and not a hang.
    for option, value, most in (("--prefill-us-per-token", args.prefill_us_per_token, 1e6),
                                ("--token-delay-ms", args.token_delay_ms, 6e4)):  # fmt: skip
        if not 0 <= value <= most:
            raise ConfigurationError(f"{option} must be a number in [0, {most:g}], not {value}")
    engines = [
        OpenAIEngine(
            model=args.model,
            lora_adapters=args.lora_adapters,
            host=args.host,
            port=args.base_port + i,
            max_tokens=args.max_tokens,
            prefill_per_token_s=args.prefill_us_per_token * 1e-6,
            token_delay_s=args.token_delay_ms / 1e3,
            seed=i,
        )  # fmt: skip
        for i in range(args.count)
    ]

    async def serve() -> None:
        # SIGTERM (systemd, Docker, a harness's terminate()) stops them as Ctrl-C does: engines closed, status 0.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            try:
                loop.add_signal_handler(sig, stop.set)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no such support
                continue
            handled[sig] = previous
        try:  # a busy port closes the engines started before it (aclose: a no-op for the others); none announced
            for engine in engines:
                await engine.serve()
            from prefixroute.cli import announce  # here: prefixroute.cli loads this module on demand

            for engine in engines:
                announce(f"fake vLLM engine serving {engine.model!r} at {engine.url}")
            await stop.wait()
        finally:
            for sig, previous in handled.items():  # the caller's handlers back (main() may run in a test process)
                loop.remove_signal_handler(sig)
                if previous is not None:  # None: a handler not set from Python, which removal leaves at the default
                    signal.signal(sig, previous)
            for engine in engines:
                await engine.aclose()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        raise ConfigurationError(f"cannot listen on {args.host}:{args.base_port}+: {exc.strerror or exc}") from exc
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixroute.testing.openai_engine``: the ``fake-engines`` command (bad options: exit 2, one line)."""
    from prefixroute.cli import main as cli_main  # here: prefixroute.cli loads this module on demand

    return cli_main(["fake-engines", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
