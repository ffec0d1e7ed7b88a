"""The decision sidecar: a :class:`~prefixroute.Router` behind a small HTTP contract, as a raw ASGI app.

=====================================  ========================================================================
``POST /route``                        ``{"prompt_token_ids" | "prompt" | "messages", "model"?, "lease"?,
                                       "backends"?}`` (with ``messages``, the chat's ``tools``, ``documents``,
                                       ``add_generation_prompt``, ``continue_final_message``,
                                       ``chat_template_kwargs`` and ``reasoning_effort`` too) → 200 ``{"id", "backend",
                                       "matched_tokens", "prompt_tokens", "reason"}``; the request counts in flight
                                       until finished
``POST /first_token``, ``/finish``     ``{"id"}`` (``/finish``: and ``"refused"?``, true for an engine's 4xx) →
                                       200 ``{"id"}``, also when repeated or unknown (counted)
``POST /v1/completions``,              the client's own OpenAI request, forwarded by a proxy: 200 with the
``POST /v1/chat/completions``          decision in headers (``X-Prefixroute-Backend``, ``-Upstream``, ``-Id``)
                                       and ``X-Accel-Redirect`` for nginx
``GET /metrics``, ``/healthz``,        Prometheus text; liveness; the counters as JSON
``/stats``
=====================================  ========================================================================

Bad input answers 4xx with ``{"error": "what to fix"}`` and changes no count; a routing policy that fails (raises,
or returns something that is not a candidate) answers 500 the same way, and is logged. The app holds no routing
logic: it decodes, calls the router, and encodes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping, Sequence
from typing import Annotated, Any, TypeGuard, cast
from urllib.parse import urlsplit

import msgspec

from prefixroute._arguments import check_lease
from prefixroute._numbers import as_int, shown
from prefixroute.adapters.proxy.prompts import chat_tokens, text_tokens
from prefixroute.adapters.serve.contract import (
    MAX_REQUEST_BACKENDS,
    BadRequest,
    FinishBody,
    LifecycleBody,
    Prompt,
    RouteBody,
    decode,
    openai_prompt,
    out_of_vocabulary,
    route_prompt,
    salted,
    truncated,
    without_bom,
)
from prefixroute.adapters.serve.metrics import RELEASE_PATHS, SidecarMetrics
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.adapters.urls import check_backend_url, check_distinct
from prefixroute.errors import ConfigurationError, InvalidTypeError, NoBackendError, PolicyError, PrefixRouteError
from prefixroute.router import Decision, Router

_log = logging.getLogger("prefixroute.serve")

__all__ = ["PICK_PATHS", "Sidecar", "upstream_of"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

PICK_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""OpenAI paths the sidecar answers with a pick (the decision in headers) for proxies that forward the request."""

_POST_PATHS = frozenset({"/route", "/first_token", "/finish", *PICK_PATHS})
_GET_PATHS = frozenset({"/metrics", "/healthz", "/stats"})
_JSON = (b"content-type", b"application/json")
# Per-request backend ids kept (in /metrics too); past this the router forgets idle ones. As many as one body may
# list, so one request never makes the sidecar forget backends it just named.
_MAX_SEEN_BACKENDS = MAX_REQUEST_BACKENDS
CLIENT_LEFT = "prefixroute.client_left"
"""The ASGI scope extension (``scope["extensions"][CLIENT_LEFT]``) by which a server tells the sidecar whether a
request's client has closed its connection: a callable of no arguments that returns True once it has, without reading
from it. ``prefixroute serve`` sets it; the sidecar then finishes, unanswered, a decision whose client left."""
_LINGER_S = 10.0
"""How long a refused body is read and dropped before its 413 (aiohttp's lingering time): a client that writes its
whole body before it reads (Node's http, Java's HttpClient) got a reset, not the answer, when the connection was
closed with its body unread."""
_LINGER_BYTES = 1 << 30  # the most of a refused body read and dropped
_INLINE_TEXT_BYTES = 64 * 2**10  # a text or chat body over this is tokenized on a worker thread, off the event loop


class _Subset(tuple[str, ...]):
    """Fixed backends a request may go to (an Envoy's subset hint): routed as the fixed list is (the health filter
    applies), not listed as a request's own backends."""

    __slots__ = ()


class Sidecar:
    """The HTTP face of a router: decode a request, route it, count it in flight, answer.

    ``backends`` is the fixed backend list, kept without a trailing ``/`` (each request may give its own ``backends``
    instead). ``encoder`` tokenizes text and chat prompts (without it they are refused with 400). ``models``, when
    given, are the only ``model`` values accepted; the first is the router's own namespace (so KV events hashed
    without a namespace match it), any other is its own namespace; a ``model`` of ``""`` is none, as vLLM serves it
    (with its base model). Without ``models`` any model is accepted: those in
    :attr:`base_models` (the backends' base model, which ``prefixroute serve`` learns from their ``/v1/models``)
    route in the router's own namespace, any other (a LoRA adapter) in its own. ``lease`` is the lease of every
    request in seconds (None: counted until finished), and the longest a ``/route`` body may ask for (a longer one is
    cut to it). ``healthy`` filters the backends to route to (e.g.
    :meth:`prefixroute.vllm.Fleet.healthy_backends`); when it leaves none, all are used (fail open).
    ``accel_redirect`` is the nginx named location (``@name``) or URI (``/path``) a pick answer redirects to.
    ``clock`` times each decision (decode, route, start) for the histogram.

    Use it as an ASGI app (``uvicorn.run(sidecar)``) or call :meth:`route`, :meth:`pick` and :meth:`finish`
    directly (the ext_proc server and the UDP release listener do). Not thread-safe by itself: run it on one
    event loop (the router underneath is thread-safe).

    >>> sidecar = Sidecar(Router(block_size=4), backends=["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    >>> decision = sidecar.route(b'{"prompt_token_ids": [1, 2, 3, 4, 5]}')
    >>> decision.reason, sidecar.router.in_flight(decision.backend)
    ('miss', 1)
    >>> sidecar.finish(decision.id); sidecar.finish(decision.id)  # idempotent
    >>> sidecar.router.in_flight(decision.backend)
    0

    Raises:
        ConfigurationError: a fixed backend is not an ``http(s)://host:port`` URL, ``lease`` is not a positive,
            finite number of seconds, ``models`` or ``base_models`` is not a collection of names (or a name in
            ``models`` is blank or given twice), ``max_body_bytes`` is not a positive int, or ``accel_redirect``
            is neither an nginx named location (``@name``) nor a URI (``/path``) in printable ASCII without spaces (a
            header value).
        TypeError: ``backends`` is not a list of URLs, ``encoder`` not a PromptEncoder, ``healthy`` or ``clock``
            not a callable.
    """

    def __init__(
        self,
        router: Router,
        *,
        backends: Sequence[str] = (),
        encoder: PromptEncoder | None = None,
        models: Sequence[str] | None = None,
        base_models: Collection[str] = (),
        lease: float | None = 600.0,
        healthy: Callable[[Sequence[str]], list[str]] | None = None,
        accel_redirect: str = "@prefixroute_upstream",
        max_body_bytes: int = 32 * 2**20,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(router, Router):
            raise InvalidTypeError(f"router must be a prefixroute.Router, not {type(router).__name__}")
        if isinstance(backends, (str, bytes)) or not isinstance(backends, Iterable):
            raise InvalidTypeError(f"backends must be a list of backend URLs, not {type(backends).__name__}")
        # Without a trailing "/": nginx's proxy_pass to the X-Prefixroute-Backend URL would take it as every request's
        # path (proxy_pass with a variable sends a URL's own path instead of the request's).
        backends = [check_backend_url(backend, path=False) for backend in backends]
        # One engine, one backend, however its URL is spelt (http://gpu0 and http://gpu0:80, :8000 and :08000, case):
        # two would split its load and its cache, and share one X-Prefixroute-Upstream (HAProxy's map key).
        check_distinct(backends, [upstream_of(backend) for backend in backends])
        lease = check_lease(lease)
        if models is not None and (
            isinstance(models, (str, bytes))
            or not isinstance(models, Iterable)
            or not (models := list(models))
            or not all(isinstance(m, str) for m in models)
        ):
            raise ConfigurationError("models must be a non-empty list of model names (or None to accept any)")
        if models is not None and not all(m.strip() for m in models):  # an unset "$MODEL": no request names it
            raise ConfigurationError(f"models must name models, not {models!r}: a name is blank")
        if models is not None and len(set(models)) != len(models):  # a typo for another model, or "$MODEL $MODEL"
            twice = next(model for i, model in enumerate(models) if model in models[:i])
            raise ConfigurationError(f"models names {twice!r} twice: name each model once")
        if encoder is not None and not (
            isinstance(getattr(encoder, "vocab_size", None), int) and callable(getattr(encoder, "encode", None))
            and callable(getattr(encoder, "encode_chat", None))
        ):  # fmt: skip
            raise InvalidTypeError(f"encoder must be a PromptEncoder or None, not {type(encoder).__name__}")
        for name, function in (("healthy", healthy), ("clock", clock)):
            if not callable(function) and not (name == "healthy" and function is None):
                raise InvalidTypeError(f"{name} must be a callable, not {type(function).__name__}")
        body_limit = as_int(max_body_bytes)
        if body_limit is None or body_limit < 1:
            raise ConfigurationError(f"max_body_bytes must be a positive int, not {shown(max_body_bytes)}")
        max_body_bytes = body_limit
        # nginx takes a named location (@name) or a URI (/path) there; a space would end the name or the path
        if not (isinstance(accel_redirect, str) and accel_redirect.isascii() and accel_redirect.isprintable()
                and accel_redirect[:1] in ("@", "/") and len(accel_redirect) > 1
                and not any(c.isspace() for c in accel_redirect)):  # fmt: skip
            raise ConfigurationError(f"accel_redirect must be an nginx named location like @prefixroute_upstream or a "
                                     f"URI like /upstream (printable ASCII without spaces, it is sent as a header "
                                     f"value), not {accel_redirect!r}")  # fmt: skip
        self.router = router
        self.backends = tuple(backends)
        self._fixed = frozenset(self.backends)
        self.metrics = SidecarMetrics()
        self._encoder = encoder
        # The largest token id the engine takes (vLLM's rule, PromptEncoder.max_token_id): a model's vocabulary may be
        # padded past its tokenizer's, and vLLM serves those ids.
        largest = getattr(encoder, "max_token_id", None)
        self._max_token_id = largest if type(largest) is int else None if encoder is None else encoder.vocab_size - 1
        # A /route body's token ids checked against that while msgspec decodes them, in C (a max() after cost ~17 µs
        # a decision at 2K ids, as much as hashing them).
        self._route_body = RouteBody
        if self._max_token_id is not None:
            bounded = list[Annotated[int, msgspec.Meta(le=self._max_token_id)]] | None
            self._route_body = cast(
                "type[RouteBody]",
                msgspec.defstruct("RouteBody", [("prompt_token_ids", bounded, None)], bases=(RouteBody,)),
            )
        self._models = tuple(models) if models is not None else None
        if (
            isinstance(base_models, (str, bytes))
            or not isinstance(base_models, Iterable)
            or not all(isinstance(m, str) for m in base_models)
        ):
            raise ConfigurationError(f"base_models must be a collection of model names, not {base_models!r}")
        self.base_models: frozenset[str] = frozenset(base_models)
        """Without ``models``: the model names that route in the router's own namespace (may be replaced)."""
        self._lease = lease
        self._healthy = healthy
        self._accel_redirect = accel_redirect.encode("latin-1")
        self._max_body = max_body_bytes
        self._clock = clock
        self._given: OrderedDict[str, None] = OrderedDict()  # per-request backends, least recently routed first
        self._given_lock = threading.Lock()
        self._upstreams: dict[str, bytes] = {}

    @property
    def max_body_bytes(self) -> int:
        """The largest request body the sidecar reads, over HTTP or ext_proc: past it, a 413 and no decision."""
        return self._max_body

    # -- the operations (also used by the ext_proc server and the UDP release listener) -------------------------------

    def route(self, body: bytes) -> Decision:
        """Decide for a ``/route`` body and count the request in flight. O(prompt + backends).

        Raises:
            BadRequest: the body breaks the contract, the model is unknown, or there is no backend.
        """
        started = self._clock()
        request, prompt, ids = self._read_route(body)
        lease = self._cut(request.lease)
        if ids is not None:
            decision = self._start(ids, self._namespace(request.model), request.backends, lease)
        else:
            decision = self.decide(prompt, model=request.model, backends=request.backends, lease=lease)
        self.metrics.decided(decision, self._clock() - started)
        return decision

    async def route_async(self, body: bytes) -> Decision:
        """:meth:`route` for the event loop: a text or chat prompt in a body over 64 KiB is tokenized on a worker
        thread, so one long prompt does not hold up every other request; a smaller one inline (no thread hop).

        Raises:
            BadRequest: as :meth:`route`.
        """
        started = self._clock()
        request, prompt, ids = self._read_route(body)
        lease = self._cut(request.lease)
        if ids is not None:
            decision = self._start(ids, self._namespace(request.model), request.backends, lease)
        else:
            decision = await self._decide_async(
                prompt, len(body), model=request.model, backends=request.backends, lease=lease
            )
        self.metrics.decided(decision, self._clock() - started)
        return decision

    def _read_route(self, body: bytes) -> tuple[RouteBody, Prompt, list[int] | None]:
        """A ``/route`` body, its prompt (:func:`route_prompt`), and that prompt's token ids when it is ids alone,
        which the decode found within the model's vocabulary if there is one (nothing left for :meth:`_tokens` to
        do), else None.

        Raises:
            BadRequest: as :func:`decode` and :func:`route_prompt`.
        """
        try:
            request = msgspec.json.decode(without_bom(body), type=self._route_body)
        except (msgspec.MsgspecError, RecursionError):
            # decode() answers a malformed body; one whose id is out of range decodes, and _tokens names the id.
            request = decode(body, RouteBody)
            return request, route_prompt(request), None
        prompt = route_prompt(request)
        ids = request.prompt_token_ids
        return request, prompt, ids if prompt is ids else None

    def pick(self, path: str, body: bytes, *, within: Collection[str] | None = None) -> Decision:
        """Decide for a client's OpenAI request body (``path`` says which kind) and count it in flight; with
        ``within`` (``host:port`` endpoints, an Envoy's subset hint), only among the backends that are one of them.

        Raises:
            BadRequest: the body is not a completion or chat completion request, or as :meth:`route`; 503 when no
                backend is ``within``.
            TypeError: ``within`` is a str or no collection (nothing is decided).
        """
        started = self._clock()
        prompt, model, salt = openai_prompt(path, body, max_token_id=self._max_token_id)
        decision = self.decide(prompt, model=model, backends=self._within(within), lease=None, cache_salt=salt)
        self.metrics.decided(decision, self._clock() - started)
        return decision

    async def pick_async(self, path: str, body: bytes, *, within: Collection[str] | None = None) -> Decision:
        """:meth:`pick` for the event loop, tokenizing a long prompt on a worker thread as :meth:`route_async`.

        Raises:
            BadRequest: as :meth:`pick`.
        """
        started = self._clock()
        prompt, model, salt = openai_prompt(path, body, max_token_id=self._max_token_id)
        decision = await self._decide_async(
            prompt, len(body), model=model, backends=self._within(within), lease=None, cache_salt=salt
        )
        self.metrics.decided(decision, self._clock() - started)
        return decision

    def _within(self, endpoints: Collection[str] | None) -> _Subset | None:
        """The fixed backends whose ``host:port`` is one of ``endpoints`` (None: no subset asked for)."""
        if endpoints is None:
            return None
        if isinstance(endpoints, (str, bytes)) or not isinstance(endpoints, Collection):  # "in" a str: a substring
            raise InvalidTypeError(f"within must be a collection of host:port strs, not {type(endpoints).__name__}")
        subset = _Subset(backend for backend in self.backends if self.upstream(backend).decode("latin-1") in endpoints)
        if not subset:
            raise BadRequest(
                503, f"none of the endpoints the request may go to ({len(endpoints)}) is one of the sidecar's backends"
            )
        return subset

    def decide(
        self,
        prompt: Prompt,
        *,
        model: str | None,
        backends: Sequence[str] | None,
        lease: float | None,
        cache_salt: object = None,
    ) -> Decision:
        """Tokenize ``prompt`` if needed, route it among ``backends`` (default: the fixed ones), start it; a request
        with vLLM's ``cache_salt`` routes in its model's namespace salted (:func:`contract.salted
        <prefixroute.adapters.serve.contract.salted>`), apart from every other salt's and the unsalted.

        Raises:
            BadRequest: 400 text without a tokenizer, token ids out of the tokenizer's range, no backend; 404 an
                unknown model.
        """
        namespace = salted(self._namespace(model), cache_salt)
        return self._start(self._tokens(prompt), namespace, backends, lease)

    async def _decide_async(
        self, prompt: Prompt, body_bytes: int, *, model: str | None, backends: Sequence[str] | None,
        lease: float | None, cache_salt: object = None,
    ) -> Decision:  # fmt: skip
        """:meth:`decide`, with a text or chat prompt from a body over ``_INLINE_TEXT_BYTES`` tokenized on a worker
        thread (the tokenizer releases the GIL) and a smaller one inline. The model is checked first: an unknown one
        costs no tokenizing."""
        if body_bytes <= _INLINE_TEXT_BYTES or self._encoder is None or _is_token_ids(prompt):
            return self.decide(prompt, model=model, backends=backends, lease=lease, cache_salt=cache_salt)
        namespace = salted(self._namespace(model), cache_salt)
        tokens = await asyncio.to_thread(self._tokens, prompt)
        return self._start(tokens, namespace, backends, lease)

    def _start(
        self, tokens: list[int], namespace: str | None, backends: Sequence[str] | None, lease: float | None
    ) -> Decision:
        given = backends is not None and not isinstance(backends, _Subset)
        if backends is None or not given:
            backends = self.backends if backends is None else backends
            if not backends:
                raise BadRequest(  # the pick mode's body is the client's OpenAI request: it cannot name backends
                    400,
                    "no backends: start the sidecar with --backends URL ... (or in a /route body's 'backends')",
                )
            if self._healthy is not None:
                backends = self._healthy(backends) or backends
        try:
            decision = self.router.route(tokens, backends, namespace=namespace)
        except NoBackendError as exc:
            raise BadRequest(400, str(exc)) from None
        except PolicyError as exc:  # the policy's fault, not the client's (it is a TypeError too: caught first)
            _log.error("the routing policy failed: %s", exc, exc_info=exc.__cause__)
            raise BadRequest(500, f"the sidecar's routing policy failed: {exc}") from None
        except (PrefixRouteError, ValueError, TypeError) as exc:
            raise BadRequest(400, str(exc)) from None
        self.router.start(decision, lease=self._lease if lease is None else lease)
        if given:  # the router accepted the list: its backends are listed in /metrics from now on
            self._see(backends)
        return decision

    def first_token(self, decision_id: str, *, via: str = "http") -> None:
        """Report that the request's first token came back. Idempotent; unknown ids are ignored and counted.

        Raises:
            ConfigurationError: ``via`` is not ``"http"``, ``"udp"`` or ``"ext_proc"`` (nothing is reported).
        """
        _check_via(via)
        self.router.first_token(decision_id)
        self.metrics.released(via)

    def finish(self, decision_id: str, *, via: str = "http", refused: bool = False) -> None:
        """Stop counting the request. Idempotent; unknown ids are ignored and counted. ``refused``: the engine
        refused it (a 4xx answer), so the router forgets the blocks it predicted there (:meth:`Router.finish`).

        Raises:
            ConfigurationError: ``via`` is not ``"http"``, ``"udp"`` or ``"ext_proc"``, or ``refused`` not a bool
                (nothing is finished).
        """
        _check_via(via)
        self.router.finish(decision_id, refused=refused)
        self.metrics.released(via)

    def answer(self, decision: Decision) -> bytes:
        """The JSON answer of ``/route`` for ``decision``.

        Raises:
            TypeError: ``decision`` is not a :class:`~prefixroute.Decision`.
        """
        if not isinstance(decision, Decision):
            raise InvalidTypeError(f"answer() takes a Decision, not {type(decision).__name__}")
        return msgspec.json.encode(
            {
                "id": decision.id,
                "backend": decision.backend,
                "matched_tokens": decision.matched_tokens,
                "prompt_tokens": decision.prompt_tokens,
                "reason": decision.reason,
            }
        )

    def upstream(self, backend: str) -> bytes:
        """``host:port`` of a backend URL (what a proxy connects to), cached. O(1) after the first call.

        Raises:
            TypeError: ``backend`` is not a str.
        """
        if type(backend) is not str:
            if not isinstance(backend, str):
                raise InvalidTypeError(f"a backend is a URL str, not {type(backend).__name__}")
            backend = str.__str__(backend)  # a subclass's own __hash__ stays out of the cache
        upstream = self._upstreams.get(backend)
        if upstream is None:
            upstream = upstream_of(backend).encode("latin-1", "replace")
            if len(self._upstreams) < _MAX_SEEN_BACKENDS:
                self._upstreams[backend] = upstream
        return upstream

    def stats(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict (``GET /stats``)."""
        stats = self.router.stats()
        return {
            "decisions": dict(self.metrics.decisions),
            "in_flight": {backend: self.router.in_flight(backend) for backend in self._seen},
            "in_flight_total": stats.in_flight,
            "leases_expired": stats.leases_expired,
            "unknown_finishes": stats.ignored,
            "releases": dict(self.metrics.releases),
            "release_datagrams_unread": self.metrics.unread_datagrams,
            "bad_requests": {str(k): v for k, v in self.metrics.bad_requests.items()},
        }

    def _cut(self, lease: float | None) -> float | None:
        """A ``/route`` body's own lease, cut to the sidecar's: ``--lease`` bounds every request, so a client cannot
        pin a decision in flight for longer (one that sends milliseconds for seconds, or a lease of years)."""
        if lease is None or self._lease is None:
            return lease
        return min(lease, self._lease)

    def _namespace(self, model: str | None) -> str | None:
        if not model:  # none, or "": vLLM serves a request naming no model with its base model
            return None
        if self._models is None:
            return None if model in self.base_models else model
        if model not in self._models:
            raise BadRequest(404, f"unknown model {model!r}: this sidecar routes {list(self._models)}")
        return None if model == self._models[0] else model

    def _tokens(self, prompt: Prompt) -> list[int]:
        """The token ids of a prompt; of a request with its options (a dict: a chat, or a prompt with vLLM's
        tokenizing fields), as vLLM keeps them (:func:`truncated`)."""
        request = prompt if isinstance(prompt, dict) else None
        if request is not None and "messages" not in request:
            prompt = request["prompt"]  # openai_prompt's: text or token ids
        if _is_token_ids(prompt):
            tokens = prompt if request is None else truncated(prompt, request)  # vLLM checks what it keeps
            if self._max_token_id is not None and max(tokens) > self._max_token_id:
                raise BadRequest(400, out_of_vocabulary(max(tokens), self._max_token_id))
            return tokens
        if self._encoder is None:
            raise BadRequest(400, "text prompts need a tokenizer: send 'prompt_token_ids', or start with --tokenizer")
        try:
            if request is not None and "messages" in request:
                tokens = chat_tokens(self._encoder, request)
            elif isinstance(prompt, str):
                tokens = text_tokens(self._encoder, prompt, request or {})
            else:
                tokens = self._encoder.encode_chat(prompt)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise BadRequest(400, str(exc)) from None
        return tokens if request is None else truncated(tokens, request)

    @property
    def _seen(self) -> list[str]:
        """The backends listed in ``/metrics`` and ``/stats``: the fixed ones, then the per-request ones kept."""
        with self._given_lock:
            return [*self.backends, *self._given]

    def _see(self, backends: Sequence[str]) -> None:
        """Note a request's own ``backends`` as routed now. Past ``_MAX_SEEN_BACKENDS`` of them, the router forgets
        the least recently routed that have no request in flight (their blocks and figures), so clients that name
        ever new backends do not grow the sidecar without end: past the cap, it keeps only those with a request in
        flight. A backend in use counts as routed now, so the next call does not look at it again (a scan that
        stepped over the same busy backends each time grew with them, ever slower). O(len(backends)), amortised."""
        with self._given_lock:
            given = self._given
            for backend in backends:
                if backend in given:
                    given.move_to_end(backend)
                elif backend not in self._fixed:
                    given[backend] = None
            excess = len(given) - _MAX_SEEN_BACKENDS
            if excess <= 0:
                return
            idle: list[str] = []
            for backend in list(itertools.islice(given, 2 * excess + 64)):
                if len(idle) == excess:
                    break
                if self.router.in_flight(backend):
                    given.move_to_end(backend)
                else:
                    idle.append(backend)
            for backend in idle:
                del given[backend]
        for backend in idle:
            self.router.remove_backend(backend)

    # -- ASGI ----------------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope (``http``; ``lifespan`` is acknowledged)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        method: str = scope["method"]
        path: str = scope["path"]
        try:
            if method == "POST" and path in _POST_PATHS:
                body = await self._body(receive, scope)
                if body is None:  # the client left before sending the whole body: decide nothing, answer no one
                    return
                await self._post(path, body, send, receive, scope)
            elif method in ("GET", "HEAD") and path in _GET_PATHS:
                await self._get(path, send)
            elif path in _POST_PATHS or path in _GET_PATHS:
                allowed = "POST" if path in _POST_PATHS else "GET, HEAD"
                raise BadRequest(405, f"{method} {path} is not served: use {allowed}")
            else:
                endpoints = (
                    "POST /route, /first_token, /finish, /v1/completions, /v1/chat/completions; "
                    "GET /metrics, /healthz, /stats"
                )
                raise BadRequest(404, f"no such endpoint {path!r}: {endpoints}")
        except BadRequest as exc:
            self.metrics.refused(exc.status)
            headers = [_JSON]
            if exc.status == 405:  # RFC 9110: a 405 names the methods the resource serves
                headers.append((b"allow", b"POST" if path in _POST_PATHS else b"GET, HEAD"))
            elif exc.status == 413:  # the body, or what is left of it, is not read: the connection cannot go on
                headers.append((b"connection", b"close"))
            await _respond(send, exc.status, msgspec.json.encode({"error": exc.message}), headers)
        except Exception as exc:  # a fault of the sidecar itself: answered in JSON too, logged, counted
            _log.exception("serving %s %s failed", method, path)
            self.metrics.refused(500)
            await _respond(send, 500, msgspec.json.encode({"error": f"the sidecar failed: {exc}"}), [_JSON])

    async def _post(self, path: str, body: bytes, send: Send, receive: Receive, scope: Scope) -> None:
        left: Callable[[], bool] | None = (scope.get("extensions") or {}).get(CLIENT_LEFT)
        if path == "/route":
            decision = await self._unless_gone(self.route_async(body), len(body), receive, left)
            if decision is not None:
                await _respond(send, 200, self.answer(decision))
        elif path == "/finish":
            finished: FinishBody = decode(body, FinishBody)
            self.finish(finished.id, refused=finished.refused)
            await _respond(send, 200, msgspec.json.encode({"id": finished.id}))
        elif path == "/first_token":
            request: LifecycleBody = decode(body, LifecycleBody)
            self.first_token(request.id)
            await _respond(send, 200, msgspec.json.encode({"id": request.id}))
        else:  # PICK_PATHS
            decision = await self._unless_gone(self.pick_async(path, body), len(body), receive, left)
            if decision is None:
                return
            answer = self.answer(decision)
            headers = [
                _JSON,
                (b"x-accel-redirect", self._accel_redirect),
                (b"x-prefixroute-backend", decision.backend.encode("latin-1", "replace")),
                (b"x-prefixroute-upstream", self.upstream(decision.backend)),
                (b"x-prefixroute-id", decision.id.encode()),
                (b"x-prefixroute-reason", decision.reason.encode()),
                (b"x-prefixroute-matched-tokens", str(decision.matched_tokens).encode()),
            ]
            await _respond(send, 200, answer, headers)

    async def _unless_gone(
        self, deciding: Awaitable[Decision], body_bytes: int, receive: Receive, left: Callable[[], bool] | None
    ) -> Decision | None:
        """Await ``deciding``, and see whether the client left meanwhile. A client that left gets no decision: one
        not made yet is not made, one made is finished as refused (it never reaches an engine), and None is returned.
        Without this, the decision would stay in flight until its lease (the server drops an answer to a client
        gone): a gateway that gave up on a sidecar stalled for a moment (a pause, a starved CPU) has closed the
        connection of every request queued meanwhile, and the sidecar, resumed, decides them all.

        A body long enough to be tokenized on a worker thread races its decision against the leaving (after its whole
        body, the next ASGI message is the disconnect); a short one is decided inline, then ``left()`` is asked, the
        server's :data:`CLIENT_LEFT` scope extension (``prefixroute serve`` gives it: a poll of the socket, ~1.6 us
        a request; a leaving seen through ``receive()`` takes the loop three turns). Under a server without it, a
        short body's client is not watched."""
        if body_bytes <= _INLINE_TEXT_BYTES:
            decision = await deciding
            if left is None or not left():
                return decision
            self.router.finish(decision.id, refused=True)
            return None
        gone = asyncio.ensure_future(receive())
        decided = asyncio.ensure_future(deciding)
        await asyncio.wait((decided, gone), return_when=asyncio.FIRST_COMPLETED)
        if not gone.done():
            # A tokenizer that held the GIL kept the loop from the client's FIN until the decision was made; both are
            # then handled in one turn, and the server's disconnect may reach ``gone`` after it woke us: one turn more.
            await asyncio.sleep(0)
        if not gone.done():
            gone.cancel()
            return decided.result()
        decided.cancel()  # at its await of the tokenizer: the decision is not made
        try:
            decision = await decided
        except (asyncio.CancelledError, BadRequest):
            return None
        self.router.finish(decision.id, refused=True)
        return None

    def _health_now(self) -> set[str] | None:
        """The fixed backends ``healthy`` says are healthy, for /healthz and /metrics; None without ``healthy``, or
        when it fails (logged: the sidecar's liveness does not hang on it)."""
        if self._healthy is None:
            return None
        try:
            return set(self._healthy(list(self.backends)))
        except Exception:
            _log.exception("the health filter failed: /healthz and /metrics say nothing of the backends' health")
            return None

    async def _get(self, path: str, send: Send) -> None:
        healthy = self._health_now() if path != "/stats" else None
        if path == "/metrics":
            up = None if healthy is None else {backend: backend in healthy for backend in self.backends}
            text = self.metrics.render(self.router, self._seen, up=up).encode()
            await _respond(send, 200, text, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
        elif path == "/healthz":  # the sidecar's liveness: 200 whatever the engines' health, which it also says
            answer: dict[str, object] = {"status": "ok", "backends": list(self.backends)}
            if healthy is not None:
                answer["healthy_backends"] = [backend for backend in self.backends if backend in healthy]
            await _respond(send, 200, msgspec.json.encode(answer))
        else:  # /stats
            await _respond(send, 200, msgspec.json.encode(self.stats()))

    async def _body(self, receive: Receive, scope: Scope) -> bytes | None:
        """The request body, or None when the client disconnected before sending all of it.

        Raises:
            BadRequest: 413 once the body is over ``max_body_bytes`` (the first chunk too), or before a byte of it is
                kept when its ``Content-Length`` says so (with ``Expect: 100-continue``, which curl sends before a
                large body, before a byte of it is read: the server then sends no ``100`` and the client no body).
                The rest of a refused body that is on its way is read and dropped first (:func:`_linger`).
        """
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self._max_body:
                if not _expects_continue(scope):  # the client is sending it: let it finish, so it reads the answer
                    await _linger(receive)
                raise BadRequest(413, f"the request body is over {self._max_body} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body:
                if message.get("more_body", False):
                    await _linger(receive)
                raise BadRequest(413, f"the request body is over {self._max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunk if len(chunks) == 1 else b"".join(chunks)


def _expects_continue(scope: Scope) -> bool:
    """Whether the request waits for a ``100 Continue`` before its body (none is sent for a refusal)."""
    return any(name == b"expect" and value.lower() == b"100-continue" for name, value in scope["headers"])


async def _linger(receive: Receive) -> None:
    """Read and drop what is left of a refused request's body, for :data:`_LINGER_S` and :data:`_LINGER_BYTES` at
    most, as aiohttp and nginx linger before they close: a connection closed with data unread is reset, and a client
    still writing its body loses the answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _LINGER_S
    read = 0
    while read < _LINGER_BYTES:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        read += len(message.get("body", b""))


def _check_via(via: object) -> None:
    if type(via) is not str or via not in RELEASE_PATHS:
        raise ConfigurationError(f"via must be one of {', '.join(RELEASE_PATHS)}, not {shown(via)}")


def _is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    return isinstance(prompt, list) and type(prompt[0]) is int


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*(headers or [_JSON]), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def upstream_of(backend: str) -> str:
    """``host:port`` of a backend URL (``http://gpu0:8000`` → ``gpu0:8000``); the backend itself if not a URL.

    Raises:
        TypeError: ``backend`` is not a str.
    """
    if not isinstance(backend, str):
        raise InvalidTypeError(f"a backend is a URL str, not {type(backend).__name__}")
    try:
        parts = urlsplit(backend)
        port = parts.port
    except ValueError:
        return backend
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return backend
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"
