"""The OpenAI-compatible proxy: route each completion to a vLLM backend with a :class:`~prefixroute.Router`, relay it.

One request's life: decode the body, take its token ids (:func:`~prefixroute.adapters.proxy.prompts.request_tokens`)
and its namespace (:meth:`Proxy.namespace`: the model it names, and its ``cache_salt``), :meth:`Router.route` among
the healthy backends that list that model (decide and commit under one lock) and :meth:`Router.start`, forward the
body unmodified, relay the answer unmodified as it comes (SSE chunk by chunk; any other answer once its first 64 KiB
have come, in bounded memory), :meth:`Router.first_token` on the first streamed chunk, and :meth:`Router.finish` in
a ``finally`` whatever happens: success, an error answer, a failed connection, or the client leaving (the handler is
cancelled, which also closes the upstream request so the engine stops generating). A 4xx answer, or an attempt on a
backend that could not be reached, is finished ``refused=True``: the engine computed nothing, so the router forgets
what it predicted there.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import io
import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.payload import TOO_LARGE_BYTES_BODY
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict, CIMultiDictProxy

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.adapters._listening import close_listener
from prefixroute.adapters._slashes import request_redirect
from prefixroute.adapters.proxy.models import MAX_MODELS_BYTES, UnreadableModels, merge_cards, model_cards
from prefixroute.adapters.proxy.prompts import (
    INLINE_TEXT,
    BadRequest,
    ByteEncoder,
    PromptEncoding,
    check_encoder,
    request_tokens,
)
from prefixroute.adapters.serve.contract import (
    UNDECODED,
    UNSUPPORTED_MEDIA_TYPE,
    base_model_names,
    decoded_as_vllm_does,
    is_json_media_type,
    is_refusal,
    json_error,
    salted,
    without_bom,
)
from prefixroute.adapters.threaded import ServerThread
from prefixroute.adapters.urls import check_backend_url, check_distinct, engine_of, host_port, listen_host
from prefixroute.errors import ConfigurationError, InvalidTypeError, PolicyError, StateError
from prefixroute.router import Decision, Router

if TYPE_CHECKING:
    from prefixroute.vllm.fleet import Fleet

__all__ = ["Proxy", "ProxyStats"]

_log = logging.getLogger("prefixroute.proxy")

# Failures to connect: the request never reached the engine, so sending it elsewhere is safe. (A connection that
# breaks after the request was sent is not retried: the engine may be generating it already.)
_UNREACHED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream; vLLM sends it last."""


@dataclass(slots=True)
class _Relayed:
    """How far a relay got: ``whole`` once the client has been sent its whole answer (the engine's end of stream, or
    its ``[DONE]`` event), so a client that leaves after that was served, not cut off; ``sent_at``, the proxy's clock
    when the request went to the engine."""

    whole: bool = False
    sent_at: float = 0.0


# A backend that breaks off its answer midway (closes, or sends less than it announced).
_BROKE_OFF = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_HELD_BYTES = 2**16
"""How much of a non-streamed answer is held before any of it goes to the client (the rest is relayed as it comes):
an answer that ends by then goes out whole, with its length, and one that breaks off by then is a 502 in JSON. A
relay holds about this much and aiohttp's buffers (some 64 KiB each way) however long the answer."""
_OUTCOMES = ("ok", "backend_error", "unreachable", "client_disconnect", "bad_request", "internal_error")
# Headers that belong to one connection (RFC 9110 7.6.1), or that the proxy sets itself: not relayed either way; nor
# are those a message's own Connection header names (see _end_to_end).
_HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                         "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"))  # fmt: skip
# The client's headers not forwarded with its body: aiohttp has already decoded a compressed body (gzip, deflate),
# so the body goes on plain, and the engine must not decode it again; and it has answered an "Expect: 100-continue"
# and read the whole body, so there is nothing left to expect (sent on, aiohttp's client would hold the body until
# the engine sent a 100, which a server need not send: with no read timeout, for ever).
_NOT_FORWARDED = _HOP_BY_HOP | {"content-encoding", "expect"}
_UPSTREAM_KEEPALIVE_S = 4.0
"""How long an idle connection to an engine is kept for the next request: under the 5 s after which vLLM's server
(uvicorn, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) closes it. Kept longer, a request could be sent just as the engine closes
the connection, a request that may have gone out and is not resent: the client got a 502 and the engine a failure."""
_SHUTDOWN_GRACE_S = 2.5  # how long a stop lets running requests finish before it cuts them off
_CLIENT_KEEPALIVE_S = 75.0
"""How long a client's idle connection is kept open for its next request, as nginx keeps one (aiohttp's default, an
hour, let idle clients hold every file descriptor)."""
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
# Where aiohttp's message starts quoting the request: a quote that opens a literal, not an apostrophe ("can't").
_QUOTED = re.compile(r"""\s*(?:^|(?<=[\s:]))(?:b|bytearray\()?['"]""")
MAX_RETRIES = 16
"""The most resends of a request whose connection failed: more would only hold a client while a fleet is down."""
MAX_BODY_BYTES = 64 * 2**20
"""The default limit on a request body: a million-token prompt as token ids is about 8 MB of JSON, a 100,000-token
one as text a few MB (vLLM itself reads any size; aiohttp's own default, 1 MiB, would refuse those)."""


@dataclass(frozen=True)
class ProxyStats:
    """What a :class:`Proxy` has done (a snapshot). Each completion request has exactly one outcome."""

    ok: int
    """Answered by a backend (any status below 500), relayed in full."""
    backend_error: int
    """A backend answered 5xx or broke off mid-answer, or its status was no final answer (a 1xx such as 101, or
    past 599: the client got 502)."""
    unreachable: int
    """No backend could be reached, retry included (the client got 502)."""
    client_disconnect: int
    """The client left before the answer was complete (or before sending its whole body)."""
    bad_request: int
    """Refused before routing (400, or 413 for a body over ``max_body_bytes``): not labelled JSON
    (``Content-Type``), not JSON, no prompt, bad token ids, a body that does not decompress as its
    ``Content-Encoding`` says."""
    internal_error: int
    """The proxy's own fault (500): the routing policy raised, or returned something that is not a candidate."""
    retries: int
    """Requests sent to another backend after the chosen one refused the connection."""
    unhealthy: tuple[str, ...]
    """Backends taken out of rotation now, after failing ``max_failures`` times in a row: until their cooldown has
    run out, or they answer a request whole (tried while every backend is out)."""
    models_skipped: int = 0
    """Times a backend was left out of a ``/v1/models`` listing because it failed to list (unreachable, no answer
    within ``models_timeout``, a 5xx, an answer that is no model list); a 4xx refusal of the client is not one."""


class Proxy:
    """An OpenAI-compatible router in front of vLLM servers (``prefixroute proxy``; see the module docstring).

    Args:
        router: decides; the proxy holds no routing logic. Its backend ids are the backends' base URLs.
        backends: base URLs of the vLLM OpenAI servers (``http://gpu0:8000``).
        encoder: text and chat messages to token ids for requests that send text (default: UTF-8 bytes,
            :class:`~prefixroute.adapters.proxy.prompts.ByteEncoder`; pass the model's tokenizer). It is called on
            a worker thread for a body over 64 KiB, so it must be thread-safe, as the library's encoders are. One
            with an int ``max_token_id`` (:class:`~prefixroute.adapters.serve.PromptEncoder`: the engine's largest
            token id) also has a prompt of token ids past it answered 400 before routing, in vLLM's words (``Token
            id N is out of vocabulary``), every prompt of a batch; without one, token ids go on as sent.
        fleet: a :class:`~prefixroute.vllm.Fleet` whose health (``/metrics`` scrapes) also filters the backends;
            its owner starts and closes it.
        retries: how many times a request whose connection failed goes to another backend, 0 to
            :data:`MAX_RETRIES` (16).
        max_failures: consecutive failures (unreachable, a 5xx answer, an answer broken off midway) that take a
            backend out of rotation for ``cooldown`` seconds. While every backend is out, all are tried, and one
            that answers whole a request sent to it while it was out is back in rotation at once.
        connect_timeout: seconds to open a connection to a backend.
        models_timeout: seconds a backend has to answer ``/v1/models`` (connection included) before that listing
            skips it, so one backend that takes the connection and never answers holds neither the proxy's start
            nor a client's listing longer. It bounds nothing else: a completion waits as long as its engine takes.
        max_body_bytes: the largest request body taken, in bytes (:data:`MAX_BODY_BYTES`, 64 MiB); a larger one is
            answered 413 and routed nowhere. The proxy holds a body whole (and its decoded JSON) while it routes it.
        base_models: the model names that are the backends' base model. A request naming another model (a LoRA
            adapter) routes in a namespace of its own, so it never shares prefixes with the base model or other
            adapters (see :meth:`namespace`). Default: learned from the backends' ``/v1/models`` (cards without
            a ``parent``), when the proxy starts and whenever it serves ``/v1/models``.
        clock: for the cooldowns.

    Raises:
        ConfigurationError: no backends, a backend that is not an http(s) URL
            (:func:`~prefixroute.adapters.urls.check_backend_url`), or a duplicate; ``retries`` not an int in [0, 16],
            ``max_failures`` not an int >= 1, ``cooldown``, ``connect_timeout`` or ``models_timeout`` not a
            positive, finite number of seconds, ``max_body_bytes`` not a positive int, a blank name in
            ``base_models`` or one given twice.
        TypeError: ``backends`` or ``base_models`` is not a collection of str (a str alone is not), ``encoder`` has
            no ``encode()`` and ``encode_chat()``, ``fleet`` is not a Fleet, ``clock`` not a callable.

    :meth:`serve` runs it on the caller's event loop; :meth:`start` on a thread of its own (tests, examples).
    """

    def __init__(
        self,
        router: Router,
        backends: Sequence[str],
        *,
        encoder: PromptEncoding | None = None,
        fleet: Fleet | None = None,
        retries: int = 1,
        max_failures: int = 3,
        cooldown: float = 10.0,
        connect_timeout: float = 2.0,
        models_timeout: float = 2.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        base_models: Collection[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(router, Router):
            raise InvalidTypeError(f"router must be a prefixroute.Router, not {type(router).__name__}")
        urls = [check_backend_url(url) for url in _names(backends, "backends", "backend URLs")]
        if not urls:
            raise ConfigurationError("the proxy needs at least one backend URL, like http://127.0.0.1:8000")
        check_distinct(urls, [engine_of(url) for url in urls])  # http://gpu0 and http://gpu0:80 are one engine
        resends = as_int(retries)
        if resends is None or not 0 <= resends <= MAX_RETRIES:
            raise ConfigurationError(f"retries must be an int in [0, {MAX_RETRIES}], not {shown(retries)}")
        threshold = as_int(max_failures)
        if threshold is None or threshold < 1:
            raise ConfigurationError(f"max_failures must be an int >= 1, not {shown(max_failures)}")
        retries, max_failures = resends, threshold
        cooldown = _positive_seconds("cooldown", cooldown)
        connect_timeout = _positive_seconds("connect_timeout", connect_timeout)
        models_timeout = _positive_seconds("models_timeout", models_timeout)
        body_limit = as_int(max_body_bytes)
        if body_limit is None or body_limit < 1:
            raise ConfigurationError(f"max_body_bytes must be a positive int, not {shown(max_body_bytes)}")
        if encoder is not None:
            check_encoder(encoder)
        if fleet is not None and not callable(getattr(fleet, "healthy_backends", None)):
            raise InvalidTypeError(f"fleet must be a prefixroute.vllm.Fleet or None, not {type(fleet).__name__}")
        if base_models is not None:
            base_models = _names(base_models, "base_models", "model names")
            if not all(name.strip() for name in base_models):  # an empty $VAR: it would match no request, learn nothing
                raise ConfigurationError(f"base_models must name models, not {sorted(base_models)!r}: a name is blank")
            if len(set(base_models)) < len(base_models):  # a typo for another model, or "$MODEL $MODEL"
                twice = next(model for i, model in enumerate(base_models) if model in base_models[:i])
                raise ConfigurationError(f"base_models names {twice!r} twice: name each model once")
        if not callable(clock):
            raise InvalidTypeError(f"clock must be a callable returning seconds, not {type(clock).__name__}")
        self.router = router
        self.backends: tuple[str, ...] = tuple(urls)
        self._encoder: PromptEncoding = encoder if encoder is not None else ByteEncoder()
        # The model's tokenizer knows the engine's largest token id: a prompt past it is refused before routing.
        largest = getattr(encoder, "max_token_id", None)
        self._max_token_id: int | None = largest if type(largest) is int else None
        self._fleet = fleet
        self._retries = retries
        self._max_failures = max_failures
        self._cooldown = cooldown
        self._connect_timeout = connect_timeout
        self._models_timeout = models_timeout
        self._max_body = body_limit
        self._clock = clock
        self._learn_models = base_models is None
        self._base_models: frozenset[str] = frozenset(() if base_models is None else base_models)
        self._served: dict[str, frozenset[str]] = {}  # each backend's model ids, as its /v1/models last listed them
        self._models_skipped = dict.fromkeys(self.backends, 0)
        self._models_failing: set[str] = set()  # backends whose last listing failed: logged once until they list
        self._learning: asyncio.Task[list[dict[str, Any]] | None] | None = None
        self._next_learning = 0.0
        self._counts = dict.fromkeys((*_OUTCOMES, "retries"), 0)
        self._failures = dict.fromkeys(self.backends, 0)
        self._down_until: dict[str, float] = {}
        self._down_since: dict[str, float] = {}  # when each backend's cooldown began
        self._quiet_until = -math.inf  # until when running out of descriptors is not logged again
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: ServerThread | None = None
        self.url = ""

    # -- running ---------------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (routes and error middleware)."""
        # One byte over: aiohttp before 3.14 refuses a body of exactly client_max_size (>=), later ones one over it;
        # the handler refuses one over max_body itself, so a body of max_body bytes is read with either.
        app = web.Application(middlewares=[_cors_preflight, _json_errors], client_max_size=self._max_body + 1)
        app.on_response_prepare.append(_allow_any_origin)
        app.router.add_post("/v1/completions", self._completions, expect_handler=self._expect)
        app.router.add_post("/v1/chat/completions", self._chat, expect_handler=self._expect)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/health", self._healthz)
        return app

    async def serve(self, *, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on the running loop; return the proxy's URL (port 0: one the OS picks). Stop with :meth:`aclose`.

        Raises:
            StateError: the proxy is serving already (:meth:`aclose` it first).
            ConfigurationError: ``host`` is no host name or address (an empty one would listen on every interface:
                say ``0.0.0.0``), or ``port`` no int in [0, 65535].
            OSError: the port is taken, or the host does not resolve to an address of this machine.
        """
        self._refuse_second_start(self._runner is not None)
        host, port = _listen_at(host, port)
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout)
        # No cookie jar: a reverse proxy keeps no client's state (aiohttp's default jar sent a cookie one client's
        # answer set with every later client's requests to that backend).
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        # handler_cancellation: a client that leaves cancels its handler, wherever it waits (also non-streaming).
        # shutdown_timeout: a stop waits that long for the requests running (aiohttp waits it twice), then cuts them
        # off, their counts ended in their finally blocks; aiohttp's 60 s outlasted every supervisor's patience.
        # The server's log is prefixroute's (its level), and says what a malformed request did wrong, not what it held.
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=_SHUTDOWN_GRACE_S, keepalive_timeout=_CLIENT_KEEPALIVE_S,
                                     logger=_ServerLog(logging.getLogger(f"{_log.name}.server")))  # fmt: skip
        try:
            await self._runner.setup()
            assert self._runner.server is not None
            # asyncio's server, made as aiohttp's TCPSite makes it but held here, so that aclose() can close it with
            # close_listener(): TCPSite's plain close loses a connection accepted the loop turn before
            self._listener = await asyncio.get_running_loop().create_server(
                self._runner.server, host, port, reuse_address=True, backlog=128
            )
        except BaseException:  # e.g. the port is taken: close the session too, so nothing is left to warn about
            await self.aclose()
            raise
        address = self._listener.sockets[0].getsockname()
        self.url = f"http://{host_port(address[0], address[1])}"
        if self._learn_models:
            await self._backend_models()  # at once, so the first requests already know the base models
        return self.url

    async def aclose(self) -> None:
        """Stop listening and close the upstream connections. Idempotent."""
        if self._learning is not None:
            self._learning.cancel()
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await close_listener(listener)  # then the runner knows every connection it accepted, to close or finish
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def start(self, *, host: str = "127.0.0.1", port: int = 0) -> Proxy:
        """Serve on a thread of its own (with its own event loop); return self once listening (see :attr:`url`).

        Raises:
            StateError: the proxy is serving already (:meth:`stop` it first).
            ConfigurationError, OSError: as :meth:`serve`.
        """
        self._refuse_second_start(self._serving is not None or self._runner is not None)
        host, port = _listen_at(host, port)
        serving = ServerThread(lambda: self.serve(host=host, port=port), self.aclose, name="prefixroute-proxy")
        serving.start()  # raises what serve() raised
        self._serving = serving
        return self

    def _refuse_second_start(self, serving: bool) -> None:
        """A second server would take over the first one's session and listener, which then nothing could stop."""
        if serving:
            raise StateError(f"the proxy is serving already, at {self.url}: stop it (stop() or aclose()) first")

    def stop(self) -> None:
        """Stop the thread :meth:`start` started. Idempotent, also from several threads at once."""
        serving = self._serving
        if serving is not None:
            serving.stop()  # locked and idempotent: a concurrent stop() waits for this one
            self._serving = None

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stats(self) -> ProxyStats:
        """Return the outcome counters and the backends out of rotation now."""
        counts = dict(self._counts)
        now = self._clock()
        down = tuple(b for b, until in list(self._down_until.items()) if until > now)
        return ProxyStats(
            ok=counts["ok"],
            backend_error=counts["backend_error"],
            unreachable=counts["unreachable"],
            client_disconnect=counts["client_disconnect"],
            bad_request=counts["bad_request"],
            internal_error=counts["internal_error"],
            retries=counts["retries"],
            unhealthy=down,
            models_skipped=sum(self._models_skipped.values()),
        )

    def namespace(self, body: dict[str, Any]) -> str | None:
        """The router namespace of a request: None for the base model (or no ``model``), else the model's name; with
        vLLM's ``cache_salt`` S (a non-empty string), that namespace (``""`` for None), a NUL, ``cache_salt:`` and S.

        A LoRA adapter's requests thus hash apart from the base model's and from other adapters', as vLLM caches
        them; and the name is what :func:`~prefixroute.vllm.lora_namespace` gives the adapter's KV events (the
        router's own namespace being None), so ``--kv-events`` confirm them too. A salted request's blocks are
        apart from every other salt's and from unsalted ones in vLLM's cache (the salt is in its first block's hash),
        so they are here too; KV events do not confirm them (vLLM publishes such blocks with ``extra_keys``, which
        the index skips). O(1).

        >>> from prefixroute import Router
        >>> proxy = Proxy(Router(), ["http://127.0.0.1:8000"], base_models=["llama"])
        >>> proxy.namespace({"model": "llama"}), proxy.namespace({"model": "sql"})
        (None, 'sql')
        >>> proxy.namespace({"model": "llama", "cache_salt": "u1"}), proxy.namespace({"model": "sql", "cache_salt": ""})
        ('\\x00cache_salt:u1', 'sql')

        Raises:
            InvalidTypeError: ``body`` is not a mapping (a request body decoded from JSON).
        """
        if type(body) is not dict and not isinstance(body, Mapping):  # a JSON body is a dict: no ABC check
            raise InvalidTypeError(f"body must be a request body decoded from JSON (a dict), not {type(body).__name__}")
        return salted(self._model_namespace(body), body.get("cache_salt"))

    def _model_namespace(self, body: Mapping[str, Any]) -> str | None:
        """The namespace of the model ``body`` names: None for the base model (or no ``model``, or ``""``, which vLLM
        serves with its base model), else its name."""
        model = body.get("model")
        return None if not isinstance(model, str) or not model or model in self._base_models else model

    @property
    def max_body_bytes(self) -> int:
        """The largest request body the proxy takes, in bytes (a larger one is answered 413)."""
        return self._max_body

    @property
    def base_models(self) -> frozenset[str]:
        """The model names that route in the base namespace (given, or learned from the backends so far)."""
        return self._base_models

    def healthy_backends(self) -> list[str]:
        """The backends requests go to: those in rotation (not cooling down after failures, and healthy in the
        fleet when there is one), or every backend when none is (better a try than a certain 502)."""
        return self._in_rotation() or list(self.backends)

    def _backends_for(self, model: object) -> list[str]:
        """The backends a request naming ``model`` goes to: the :meth:`healthy_backends` but those whose
        ``/v1/models`` did not list it, unless none listed it (then all, and the engine answers for a model it lacks).

        A backend whose models are not known yet counts as serving every model. O(backends).
        """
        healthy = self.healthy_backends()
        if not isinstance(model, str) or not self._served:
            return healthy
        return [b for b in healthy if model in self._served.get(b, (model,))] or healthy

    def _in_rotation(self) -> list[str]:
        now = self._clock()
        healthy = [b for b in self.backends if self._down_until.get(b, 0.0) <= now]
        if self._fleet is not None:
            healthy = self._fleet.healthy_backends(healthy)
        return healthy

    # -- completions -----------------------------------------------------------------------------------------------

    def _tokens(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], list[int]]:
        body = _decode(raw)
        return body, request_tokens(body, chat=chat, encoder=self._encoder, max_token_id=self._max_token_id)

    def _too_large(self) -> web.Response:
        message = f"the request body is over the proxy's limit of {self._max_body} bytes (max_body_bytes)"
        return self._refused_unread(413, message, "RequestEntityTooLargeError")

    def _refused_unread(self, status: int, message: str, kind: str) -> web.Response:
        """A client's request refused with its body (or the rest of it) unread, counted: the answer says
        ``Connection: close``, since the connection then carries no other request."""
        self._counts["bad_request"] += 1
        response = error_response(status, message, kind)
        response.force_close()
        return response

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` (curl sends it before a large body): a request refused from its head alone (a
        body over the limit, one not labelled JSON) is answered before the client sends the body, not once it has;
        else a ``100 Continue``; another expectation is a 417 in the proxy's error JSON."""
        expect = request.headers.get("Expect", "")
        if request.version != aiohttp.HttpVersion11:
            return None
        if expect.lower() != "100-continue":
            message = f"unknown expectation Expect: {expect}: send Expect: 100-continue, or no Expect"
            return self._refused_unread(417, message, "ExpectationFailedError")
        if not is_json_media_type(request.headers.get("Content-Type")):  # first, as _proxy() checks
            refusal = BadRequest(UNSUPPORTED_MEDIA_TYPE)
            return self._refused_unread(refusal.status, str(refusal), refusal.kind)
        if (request.content_length or 0) > self._max_body:
            return self._too_large()
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes start after the interim one
        return None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, chat=True)

    async def _proxy(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            if not is_json_media_type(request.headers.get("Content-Type")):  # as vLLM: before the body is read
                raise BadRequest(UNSUPPORTED_MEDIA_TYPE)
            if (request.content_length or 0) > self._max_body:  # refused before a byte of it is read
                return self._too_large()
            raw = await request.read() if request.content.is_eof() else await _read_unless_stalled(request)
            if len(raw) > self._max_body:  # a chunked body (no Content-Length) one byte over: see app()
                return self._too_large()
            if len(raw) > INLINE_TEXT:  # decoding and tokenizing a long prompt on the loop would hold every stream up
                body, tokens = await asyncio.to_thread(self._tokens, raw, chat)
            else:
                body, tokens = self._tokens(raw, chat)
            model = body.get("model")
            if model is not None and not isinstance(model, str):  # as vLLM's request model and the sidecar refuse it
                raise BadRequest(f"'model' must be a string, the model's name, not {type(model).__name__}")
            namespace = self.namespace(body)
            if isinstance(model, str) and self._unlearned(self._model_namespace(body)):
                self._learn_later(_auth(request))
            backends = self._backends_for(model)
            decision = self.router.route(tokens, backends, namespace=namespace)  # decide and commit, one lock
        except PolicyError as exc:  # the policy's fault, not the client's (it is a TypeError too: caught first)
            self._counts["internal_error"] += 1
            return _policy_failed(exc)
        except (BadRequest, ValueError, TypeError) as exc:  # ValueError: bad token ids, messages a template refuses
            self._counts["bad_request"] += 1
            status, kind = (exc.status, exc.kind) if isinstance(exc, BadRequest) else (400, "BadRequestError")
            return error_response(status, str(exc), kind)
        except RequestPayloadError as exc:  # e.g. a body that does not decompress as its Content-Encoding says
            self._counts["bad_request"] += 1
            return error_response(400, f"the request body could not be read: {exc}", "BadRequestError")
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        except _Stalled:
            message = f"the request body stopped coming: nothing for {_BODY_STALL_S:g} s"
            return self._refused_unread(408, message, "RequestTimeoutError")
        except (asyncio.CancelledError, ConnectionError):  # the client left before its whole body came
            self._counts["client_disconnect"] += 1
            raise
        except Exception as exc:  # anything else is the proxy's own fault: say so, in JSON, and count it
            _log.exception("routing a request failed")
            self._counts["internal_error"] += 1
            return error_response(500, f"the proxy failed to route the request: {exc}", "InternalServerError")
        # The client's own headers go on (Authorization, request ids, tracing), but not an encoding the client did
        # not ask for: the answer is relayed as it comes.
        headers = _end_to_end(request.headers, _NOT_FORWARDED)
        headers.setdefault("Accept-Encoding", "identity")
        session = self._session
        assert session is not None, "serve() opens the session"
        upstream: aiohttp.ClientResponse | None = None
        outcome = "client_disconnect"
        relayed = _Relayed()
        tried: list[str] = []
        started = False
        try:
            while upstream is None:
                self.router.start(decision)
                started = True
                relayed.sent_at = self._clock()
                try:
                    upstream = await session.post(  # a redirect is the engine's answer, relayed (as nginx does)
                        decision.backend + request.path_qs, data=_payload(raw), headers=headers, allow_redirects=False
                    )
                except _UNREACHED as exc:
                    self.router.finish(decision, refused=True)  # never reached the engine: it cached nothing there
                    started = False
                    if getattr(getattr(exc, "os_error", None), "errno", None) in _OUT_OF_DESCRIPTORS:
                        # The proxy's own fault, not the engine's: no socket to reach it with.
                        outcome = "internal_error"
                        if self._clock() >= self._quiet_until:  # a line every 10 s at most, not one a request
                            self._quiet_until = self._clock() + 10.0
                            _log.error("out of file descriptors: raise the proxy's limit (ulimit -n)")
                        message = "the proxy is out of file descriptors; retry later"
                        answer = error_response(503, message, "ServiceUnavailableError")
                        answer.headers["Retry-After"] = "1"
                        return answer
                    self._failed(decision.backend)
                    tried.append(decision.backend)
                    remaining = [b for b in backends if b not in tried]
                    if len(tried) > self._retries or not remaining:
                        outcome = "unreachable"
                        message = f"backend {decision.backend} is unreachable: {exc}"
                        return error_response(502, message, "BadGatewayError")
                    self._counts["retries"] += 1
                    try:
                        retry = self.router.decide(tokens, remaining, namespace=namespace)
                    except PolicyError as exc:  # e.g. a bug only fewer candidates reach: as in the first decision
                        outcome = "internal_error"
                        return _policy_failed(exc)
                    decision = self.router.commit(decision, retry.backend)
                except aiohttp.ClientError as exc:  # it took the request, then failed or answered in broken HTTP
                    self._failed(decision.backend)
                    outcome = "backend_error"
                    message = f"backend {decision.backend} failed to answer: {exc}"
                    return error_response(502, message, "BadGatewayError")
                except Exception as exc:  # anything else on the way out is the proxy's fault: say so, in JSON
                    _log.exception("forwarding to backend %s failed", decision.backend)
                    outcome = "backend_error"
                    return error_response(502, f"the proxy could not forward the request: {exc}", "BadGatewayError")
            stream = body.get("stream") is True
            response, outcome = await self._relay(request, upstream, decision, stream=stream, relayed=relayed)
            return response
        finally:
            if started:
                # A 4xx answer (vLLM's 400 for a prompt past its context) is a refusal: the engine computed nothing,
                # so the router forgets the blocks it predicted there. A 5xx or a broken connection is not.
                refused = upstream is not None and is_refusal(upstream.status)
                self.router.finish(decision, refused=refused)
            if outcome == "client_disconnect" and relayed.whole:
                # The client left once its answer was whole (OpenAI's client closes at [DONE]).
                outcome = _whole_outcome(upstream)
            if upstream is not None:
                upstream.close()  # a half-read answer closes its connection (the engine stops); a read one is free
            self._counts[outcome] += 1

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        decision: Decision,
        *,
        stream: bool,
        relayed: _Relayed,
    ) -> tuple[web.StreamResponse, str]:
        """Send ``upstream``'s answer to the client as it comes; return the response and the request's outcome.
        ``relayed`` notes when the client has its whole answer, for a cancellation after that (a client gone)."""
        if not 200 <= upstream.status <= 599:
            # A 1xx as the final answer (a 101 relayed without its upgrade leaves the client waiting for ever), or a
            # code HTTP does not have, which RFC 9110 15 has a client take for a 5xx: the engine's fault either way.
            self._failed(decision.backend)
            message = f"backend {decision.backend} answered HTTP status {upstream.status}, which is no final answer"
            return error_response(502, message, "BadGatewayError"), "backend_error"
        content_type = upstream.headers.get("Content-Type", "application/json")
        # A multidict: a header the engine repeats (Set-Cookie) is relayed as many times.
        headers = _end_to_end(upstream.headers, _HOP_BY_HOP)
        headers.update(_decision_headers(decision))
        if upstream.status >= 500:
            self._failed(decision.backend)
        # A stream is what the engine streams: it may read a "stream" that is not the JSON true as true (vLLM does).
        if upstream.status == 200 and (stream or content_type.startswith("text/event-stream")):
            response = web.StreamResponse(status=200, headers=headers)
            return response, await self._pipe(request, response, upstream, decision, relayed=relayed, stream=True)
        # Any other answer: held until _HELD_BYTES have come, so that one that ends by then (most do) goes out whole,
        # with its length, and one that breaks off by then is a 502 in JSON, nothing having gone to the client yet.
        held = bytearray()
        try:
            while len(held) < _HELD_BYTES:
                chunk = await upstream.content.readany()
                if not chunk:  # the end of the answer
                    answer = web.Response(status=upstream.status, body=bytes(held), headers=headers)
                    if upstream.status >= 500:
                        return answer, "backend_error"
                    self._answered_whole(decision.backend, relayed.sent_at)
                    return answer, "ok"
                held += chunk
        except _BROKE_OFF as exc:
            if upstream.status < 500:  # a 5xx has counted as a failure already
                self._failed(decision.backend)
            message = f"backend {decision.backend} broke off its answer: {exc}"
            return error_response(502, message, "BadGatewayError"), "backend_error"
        # A larger answer is relayed as it comes, in bounded memory (as nginx does), with the engine's length if it
        # gave one: the proxy never holds a whole answer of hundreds of MB.
        response = web.StreamResponse(status=upstream.status, headers=headers)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        outcome = await self._pipe(request, response, upstream, decision, relayed=relayed, head=bytes(held))
        return response, outcome

    async def _pipe(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        decision: Decision,
        *,
        relayed: _Relayed,
        head: bytes = b"",
        stream: bool = False,
    ) -> str:
        """Send ``response``'s head, then ``head`` and the rest of ``upstream``'s answer as it comes; return the
        request's outcome. A ``stream`` (SSE) reports its first chunk as the first token and is whole at its
        ``[DONE]`` event too. Only an answer relayed to its end ends the backend's streak of failures (and its
        cooldown); one that breaks off is a failure."""
        failed = upstream.status >= 500  # counted as a failure when it answered
        first = stream
        try:
            # A client that leaves closes its transport at once but cancels this handler a loop turn later: the
            # headers or the end written in between raise ConnectionResetError too, a client gone (not an error).
            await response.prepare(request)
            if head:
                await response.write(head)
            async for chunk in upstream.content.iter_any():
                if first:
                    self.router.first_token(decision)
                    first = False
                await response.write(chunk)
                if stream and chunk.endswith(_SSE_DONE):  # OpenAI's last event: its clients may close now
                    relayed.whole = True
            relayed.whole = True
            if not failed:
                self._answered_whole(decision.backend, relayed.sent_at)  # not when it broke off: above 1 for ever
            await response.write_eof()
        except _BROKE_OFF as exc:
            what = "a streamed answer" if stream else f"an answer ({upstream.status}) after its first bytes"
            _log.warning("backend %s broke off %s: %s", decision.backend, what, exc)
            if not failed:
                self._failed(decision.backend)
            # Break the client's connection too, before the end (short of the Content-Length, or without the last
            # chunk): it sees an incomplete answer, never a whole one.
            if request.transport is not None:
                request.transport.abort()
            return "backend_error"
        except ConnectionError:  # writing to a client that has gone
            return _whole_outcome(upstream) if relayed.whole else "client_disconnect"
        return _whole_outcome(upstream)

    def _unlearned(self, namespace: str | None) -> bool:
        """Whether a backend has not listed its models yet, or (learning them) no base model is known."""
        unknown_base = namespace is not None and self._learn_models and not self._base_models
        return unknown_base or len(self._served) < len(self.backends)

    def _learn_later(self, headers: dict[str, str]) -> None:
        """Not every backend has listed its models yet: ask again, at most every 10 s (meanwhile models stay apart,
        and requests may go to backends that lack their model)."""
        if self._clock() >= self._next_learning:
            self._next_learning = self._clock() + 10.0
            self._learning = asyncio.get_running_loop().create_task(self._backend_models(headers))

    def _answered_whole(self, backend: str, sent_at: float) -> None:
        """``backend`` gave a whole answer (below 500) to a request sent at ``sent_at``: its streak of failures ends;
        so does a cooldown it went into before that request was sent (it was tried because every backend was out),
        so that routing, ``/healthz`` and ``/metrics`` count it in rotation again at once, not only once its cooldown
        has run out. A request sent before the cooldown (a stream still finishing on an engine whose listener is
        gone, as in a rolling restart) does not end it. O(1)."""
        self._failures[backend] = 0
        since = self._down_since.get(backend)
        if since is not None and sent_at >= since:
            del self._down_since[backend]
            self._down_until.pop(backend, None)

    def _failed(self, backend: str) -> None:
        failures = self._failures[backend] = self._failures.get(backend, 0) + 1
        if failures >= self._max_failures:
            self._down_since[backend] = now = self._clock()
            self._down_until[backend] = now + self._cooldown
            self._failures[backend] = 0
            _log.warning("backend %s failed %d times in a row: out of rotation for %.0f s", backend, failures,
                         self._cooldown)  # fmt: skip

    # -- the other endpoints ---------------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        """``/v1/models`` merged from every backend in rotation: their model objects, once per id (see
        :func:`~prefixroute.adapters.proxy.models.model_cards`); a backend that fails to list within
        ``models_timeout`` is skipped. When none listed but one refused the client (4xx, e.g. 401 for a missing API
        key), that refusal is relayed as the engine gave it; otherwise 502."""
        answers = await self._ask_models(_auth(request))
        cards = self._merge_models(answers)
        if cards is not None:
            return web.json_response({"object": "list", "data": cards})
        refusal = next((a for a in answers if isinstance(a, _Refused) and 400 <= a.status < 500), None)
        if refusal is not None:
            return web.Response(status=refusal.status, body=refusal.body, content_type=refusal.content_type)
        return error_response(502, "no backend answered /v1/models", "BadGatewayError")

    async def _backend_models(self, headers: dict[str, str] | None = None) -> list[dict[str, Any]] | None:
        """The model cards of the backends in rotation, merged by id (None: none answered); learn the base models.

        ``headers``: the client's ``Authorization``, for backends that require an API key.
        """
        return self._merge_models(await self._ask_models(headers))

    async def _ask_models(self, headers: dict[str, str] | None) -> list[list[dict[str, Any]] | BaseException]:
        """Each backend in rotation's model cards, or why it gave none (:class:`_Refused` for a 4xx), each within
        ``models_timeout``; a backend that failed to list is logged (once until it lists again) and counted."""
        session = self._session
        assert session is not None
        # Per request, so only these: the session's own timeout (none after connecting) stays the completions'.
        timeout = aiohttp.ClientTimeout(total=self._models_timeout)

        # identity: the session does not decompress (an answer is relayed as the engine sent it), so a list gzipped
        # by a hop between (an ingress's gzip_types application/json) was no JSON, and a refusal lost its encoding.
        asked = {**(headers or {}), "Accept-Encoding": "identity"}

        async def models(backend: str) -> list[dict[str, Any]]:
            async with session.get(
                f"{backend}/v1/models", timeout=timeout, headers=asked, allow_redirects=False
            ) as reply:
                raw = await _read_at_most(reply, MAX_MODELS_BYTES)
                if reply.status >= 400:
                    raise _Refused(reply.status, raw, reply.content_type)
            cards = model_cards(raw)
            self._served[backend] = frozenset(card["id"] for card in cards)
            return cards

        backends = self.healthy_backends()
        answers = await asyncio.gather(*(models(b) for b in backends), return_exceptions=True)
        for backend, answer in zip(backends, answers, strict=True):
            if isinstance(answer, list) or isinstance(answer, _Refused) and answer.status < 500:
                self._models_failing.discard(backend)  # it answers: a refusal is the client's to fix
            else:
                self._models_skipped[backend] += 1
                log = _log.debug if backend in self._models_failing else _log.warning
                self._models_failing.add(backend)
                log("backend %s is left out of /v1/models until it lists again: %s", backend, self._why(answer))
        return answers

    def _why(self, failure: BaseException) -> str:
        """Why a backend's ``/v1/models`` gave no list, in a few words."""
        if isinstance(failure, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
            return f"no answer within {self._models_timeout:g} s"
        if isinstance(failure, aiohttp.ClientConnectorError):
            return f"unreachable ({failure})"
        if isinstance(failure, _Refused):
            return f"HTTP {failure.status}"
        if isinstance(failure, UnreadableModels):
            return f"its answer is no model list: {failure}"
        return f"{type(failure).__name__}: {failure}"

    def _merge_models(self, answers: list[list[dict[str, Any]] | BaseException]) -> list[dict[str, Any]] | None:
        """The cards of ``answers`` merged by id (None: no backend gave a list); learn the base models from them
        (:func:`~prefixroute.adapters.serve.contract.base_model_names`)."""
        lists = [answer for answer in answers if isinstance(answer, list)]
        if not lists:
            return None
        merged = merge_cards(lists)
        if self._learn_models:
            self._base_models = base_model_names(merged)
        return merged

    async def _healthz(self, request: web.Request) -> web.Response:
        healthy = self._in_rotation()
        body = {"status": "ok" if healthy else "unavailable", "healthy_backends": healthy}
        return web.json_response(body, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain", charset="utf-8")

    def metrics_text(self) -> str:
        """The proxy's Prometheus text: request outcomes, retries, and per backend in-flight and health."""
        stats = self.stats()
        router = self.router.stats()
        up = set(self._in_rotation())
        # Backend URLs are printable ASCII (check_backend_url): only a backslash or a quote needs escaping.
        labels = {b: b.replace("\\", "\\\\").replace('"', '\\"') for b in self.backends}
        lines = _head("prefixroute_proxy_requests_total", "counter", "Completion requests by outcome.")
        lines += [f'prefixroute_proxy_requests_total{{outcome="{o}"}} {getattr(stats, o)}' for o in _OUTCOMES]
        lines += _head("prefixroute_proxy_retries_total", "counter", "Requests resent after a refused connection.")
        lines.append(f"prefixroute_proxy_retries_total {stats.retries}")
        lines += _head("prefixroute_router_decisions_total", "counter", "Routing decisions made.")
        lines.append(f"prefixroute_router_decisions_total {router.decisions}")
        lines += _head("prefixroute_router_in_flight", "gauge", "Requests in flight, by backend.")
        lines += [f'prefixroute_router_in_flight{{backend="{labels[b]}"}} {self.router.in_flight(b)}' for b in labels]
        lines += _head("prefixroute_proxy_backend_up", "gauge", "1 while a backend is in rotation, else 0.")
        lines += [f'prefixroute_proxy_backend_up{{backend="{labels[b]}"}} {int(b in up)}' for b in labels]
        lines += _head("prefixroute_proxy_models_skipped_total", "counter", "Model listings a backend failed to give.")
        skipped = self._models_skipped
        lines += [f'prefixroute_proxy_models_skipped_total{{backend="{labels[b]}"}} {skipped[b]}' for b in labels]
        return "\n".join(lines) + "\n"


def _head(name: str, kind: str, help_text: str) -> list[str]:
    """A metric family's HELP and TYPE lines, named as its samples are (a counter with ``_total``, as
    prometheus_client writes the text format)."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


_decoder = msgspec.json.Decoder()


def _decode(raw: bytes) -> Any:
    """A request body as vLLM's server decodes it; else the 400 that says why not (:func:`json_error`)."""
    try:
        return _decoder.decode(without_bom(raw))
    except (msgspec.DecodeError, RecursionError) as exc:
        body = decoded_as_vllm_does(raw)
        if body is UNDECODED:
            raise BadRequest(json_error(raw, exc)) from None
        return body


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]  # generic only from Python 3.11
    """aiohttp's server log, but a request the client malformed (broken HTTP, a body that does not decode as its
    ``Content-Encoding`` says) is one warning line instead of an error with a traceback: any client can send one, and
    the proxy has done nothing wrong (aiohttp answers it 400). The line says what was wrong, never the bytes aiohttp's
    message quotes (they hold the client's headers and prompt: its API key, its data). The proxy's own faults keep
    their traceback."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if level >= logging.ERROR and isinstance(exc_info, (HttpProcessingError, RequestPayloadError)):
            what = str(msg) % args if args else str(msg)
            level, msg, args, exc_info = logging.WARNING, "%s: %s", (what, _reason(exc_info)), None
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


def _reason(exc: Exception) -> str:
    """What a client's malformed request did wrong, from aiohttp's error, without the bytes it quotes: its message
    is ``reason:\n\n  detail: b'<the request's bytes>' ^`` (the C parser's), ``reason '<bytes>'`` (the Python
    parser's) or a reason alone (a payload's): cut at its first quote."""
    text = " ".join(str(getattr(exc, "message", "") or exc).split())
    text = _QUOTED.split(text, maxsplit=1)[0].rstrip(" :")
    code = getattr(exc, "code", None)
    return f"{code} {text[:200]}" if isinstance(code, int) else text[:200]


async def _read_at_most(reply: aiohttp.ClientResponse, limit: int) -> bytes:
    """A backend's answer, read whole unless it is over ``limit`` bytes.

    Raises:
        UnreadableModels: the answer is over ``limit`` bytes (what came is not kept).
    """
    raw = bytearray()
    async for chunk in reply.content.iter_chunked(2**16):
        raw += chunk
        if len(raw) > limit:
            raise UnreadableModels(f"over {limit} bytes")
    return bytes(raw)


class _Refused(Exception):
    """A backend answered ``/v1/models`` with an error status: the answer, to relay when no backend gave a list."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class _Stalled(Exception):
    """A request body that stopped coming (see :func:`_read_unless_stalled`)."""


_BODY_STALL_S = 60.0
"""How long a request body may go without a byte before it is answered 408 (nginx's client_body_timeout): a body
that stopped coming held its request, and the up to 64 MiB it had sent, for ever."""


async def _read_unless_stalled(request: web.Request) -> bytes:
    """``request.read()``, unless nothing of the body comes for :data:`_BODY_STALL_S` (then :class:`_Stalled`).

    Only for a body not already whole when the handler starts (most are): a watch costs a task."""
    loop = asyncio.get_running_loop()
    reading = asyncio.ensure_future(request.read())
    seen, since = request.content.total_bytes, loop.time()
    try:
        while True:  # looked at four times a stall's length: a 408 between 60 and 75 s after the last byte
            done, _ = await asyncio.wait({reading}, timeout=_BODY_STALL_S / 4)
            if done:
                return reading.result()
            if request.content.total_bytes != seen:
                seen, since = request.content.total_bytes, loop.time()
            elif loop.time() - since >= _BODY_STALL_S:
                raise _Stalled
    finally:
        reading.cancel()


def _whole_outcome(upstream: aiohttp.ClientResponse | None) -> str:
    """The outcome of a request whose answer was relayed whole: a 5xx is the backend's error, any other ``ok``."""
    return "backend_error" if upstream is not None and upstream.status >= 500 else "ok"


def _names(values: object, name: str, what: str) -> list[str]:
    """``values`` as a list of str, else InvalidTypeError (a str alone would be taken for its characters)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidTypeError(f"{name} must be a collection of {what} (str), not {type(values).__name__}")
    names = list(values)
    for value in names:
        if not isinstance(value, str):
            raise InvalidTypeError(f"{name} must hold {what} (str), not {type(value).__name__}")
    return names


def _positive_seconds(name: str, value: object) -> float:
    """``value`` as a plain float if it is a positive, finite number of seconds; else a ConfigurationError."""
    seconds = as_float(value)
    if seconds is None or seconds <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite number of seconds, not {shown(value)}")
    return seconds


def _payload(raw: bytes) -> bytes | io.BytesIO:
    """A request body as the upstream request sends it: bytes, or over 1 MiB a BytesIO (which aiohttp writes in
    chunks; for bytes that large it warns that they might hold the loop up, an error where warnings are). CPython's
    BytesIO shares the bytes it starts with, so this copies nothing. A new one for each attempt: it is closed once
    sent."""
    return raw if len(raw) <= TOO_LARGE_BYTES_BODY else io.BytesIO(raw)


def _end_to_end(headers: CIMultiDictProxy[str], dropped: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` to relay, each as many times as it came: all but those in ``dropped`` (lowercase names) and those
    the message's own ``Connection`` header names (``Connection: keep-alive, X-Hop``), which RFC 9110 7.6.1 makes
    fields of one connection that a proxy removes. O(headers)."""
    if "Connection" in headers:
        named = {name.strip().lower() for value in headers.getall("Connection") for name in value.split(",")}
        dropped = dropped | named
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def _auth(request: web.Request) -> dict[str, str]:
    """The client's ``Authorization`` header, to pass on to the backends (empty without one)."""
    value = request.headers.get("Authorization")
    return {} if value is None else {"Authorization": value}


def _decision_headers(decision: Decision) -> dict[str, str]:
    return {"X-Prefixroute-Backend": decision.backend, "X-Prefixroute-Reason": decision.reason,
            "X-Prefixroute-Matched-Tokens": str(decision.matched_tokens)}  # fmt: skip


def _policy_failed(exc: PolicyError) -> web.Response:
    """Log a routing policy's failure (with the policy's own exception) and answer it as the proxy's fault."""
    _log.error("the routing policy failed: %s", exc, exc_info=exc.__cause__)
    return error_response(500, f"the proxy's routing policy failed: {exc}", "InternalServerError")


def error_response(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error answer, as vLLM writes it."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


# CORS as vLLM's OpenAI server allows it by default (Starlette's CORSMiddleware, every origin, method and header, no
# credentials), so a browser client that called vLLM directly still works through the proxy.
_PREFLIGHT_HEADERS = MappingProxyType(
    {
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Methods": "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT",
        "Access-Control-Max-Age": "600",
    }
)


@web.middleware
async def _cors_preflight(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """Answer a browser's CORS preflight (OPTIONS with ``Origin`` and ``Access-Control-Request-Method``) with 200,
    allowing any origin, method and the headers asked for; any other request goes on."""
    headers = request.headers
    if request.method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers:
        allowed = {
            **_PREFLIGHT_HEADERS,
            "Access-Control-Allow-Headers": headers.get("Access-Control-Request-Headers", ""),
        }
        return web.Response(text="OK", headers=allowed)
    response: web.StreamResponse = await handler(request)
    return response


async def _allow_any_origin(request: web.Request, response: web.StreamResponse) -> None:
    """Before any answer's headers go out (a stream's too): ``Access-Control-Allow-Origin: *`` for a request with an
    ``Origin``, unless the engine's answer already says."""
    if "Origin" in request.headers and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = "*"


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """aiohttp's own refusals (404, 405, 413) as OpenAI-style JSON errors too; a 404 for a route's path with
    trailing slashes is a redirect to the route, as vLLM's app answers it
    (:func:`~prefixroute.adapters._slashes.request_redirect`)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404 and (location := request_redirect(request)) is not None:
            return web.Response(status=307, headers={"Location": location})
        answer = error_response(exc.status, f"{exc.reason}: {request.method} {request.path}",
                                exc.reason.replace(" ", "") + "Error")  # fmt: skip
        if "Allow" in exc.headers:  # a 405 says which methods the path takes
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer


def _listen_at(host: object, port: object) -> tuple[str, int]:
    """``host`` and ``port`` to listen at, checked before anything starts (asyncio's own errors would be an
    OverflowError from deep inside, and None or "" would listen on every interface unsaid)."""
    try:
        name = listen_host(host)  # type: ignore[arg-type]
    except argparse.ArgumentTypeError as exc:
        raise ConfigurationError(f"host: {exc}") from None
    number = as_int(port)
    if number is None or not 0 <= number <= 65535:
        raise ConfigurationError(f"port must be an int in [0, 65535] (0: one the OS picks), not {shown(port)}")
    return name, number
