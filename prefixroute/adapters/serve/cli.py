"""``prefixroute serve``: run the decision sidecar (HTTP, and optionally Envoy ext_proc and a UDP release listener).

Listens on ``--host``/``--port`` (HTTP), ``--ext-proc PORT`` (gRPC, Envoy's endpoint picker) and
``--release-port PORT`` (UDP syslog lines carrying ``prefixroute_finish=<id>``), all on ``--host``. Prints one line
per listener on stdout once all of them are bound. Bad options, a tokenizer path that does not exist and a port that
cannot be bound end it with exit status 2 and one line on stderr (and nothing on stdout). SIGINT or SIGTERM stops it
gracefully, with exit status 0. ``--kv-events BACKEND=ENDPOINT[,REPLAY]`` and
``--metrics-from-backends`` need the ``vllm`` extra: the index then follows each engine's KV events (so replicas of
the sidecar agree without talking to each other) and unhealthy engines are skipped. Without ``--models``, the
backends' base model (a card without a ``parent`` in their ``/v1/models``) is learned in the background, at start
and every 10 s until a backend answers: requests naming it route in the router's own namespace, where the KV events
of the base model land, and other models (LoRA adapters) in their own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.client
import json
import logging
import math
import select
import signal
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from prefixroute.adapters._listening import raise_open_files_limit
from prefixroute.adapters.urls import check_backend_url, engine_of, host_port, listen_host
from prefixroute.cli import MAX_BODY_MIB, announce, body_mib, positive_int
from prefixroute.errors import ConfigurationError, StateError

__all__ = ["BaseModelLearner", "register", "run"]

_log = logging.getLogger("prefixroute.serve")


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve",
        help="run the HTTP decision sidecar for nginx, HAProxy and Envoy",
        description=(__doc__ or "").replace("``", "`"),  # the module docstring, without its reST markup
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backends", nargs="+", default=[], metavar="URL", help="engine URLs, http://host:port")
    parser.add_argument(
        "--policy",
        default="predicted-ttft",
        help="load policy name, or package.module:ClassName (default predicted-ttft, the library's)",
    )
    parser.add_argument(
        "--policy-option", action="append", default=[], metavar="KEY=VALUE",
        help="policy option, each KEY once: an int, a float, true or false (a flag), else text; e.g. factor=1.5, "
        "use_speed=true",
    )  # fmt: skip
    parser.add_argument("--tokenizer", metavar="PATH", help="local tokenizer.json, or a model folder holding one")
    parser.add_argument(
        "--block-size", type=positive_int, default=16, metavar="N", help="tokens per block (default 16, vLLM's)"
    )
    parser.add_argument(
        "--host", type=listen_host, default="127.0.0.1", help="address of every listener (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=_port, default=8100, metavar="P", help="HTTP port (default 8100; 0: any)")
    parser.add_argument(
        "--lease", type=_seconds, default=600.0, metavar="SECONDS",
        help="lease of a request, and the longest a /route body may ask for (default 600)",
    )  # fmt: skip
    parser.add_argument(
        "--max-body-mib", type=body_mib, default=32, metavar="MIB",
        help=f"the largest request body taken, 1 to {MAX_BODY_MIB} MiB (default 32); a larger one is answered 413 "
        "and the gateway sends it to its own pool. Raise it with the gateway's limit (nginx's "
        "client_max_body_size) for prompts of millions of tokens",
    )  # fmt: skip
    parser.add_argument("--models", nargs="+", metavar="NAME", help="the only accepted models (the first: default)")
    parser.add_argument(
        "--kv-events", nargs="+", default=[], metavar="BACKEND=ENDPOINT[,REPLAY]",
        help="a backend of --backends and its KV-event publisher, optionally its replay endpoint, e.g. "
        "http://gpu0:8000=tcp://gpu0:5557,tcp://gpu0:5558 (needs the vllm extra)",
    )  # fmt: skip
    parser.add_argument(
        "--data-parallel-size", type=positive_int, metavar="N",
        help="engines per backend (vLLM's --data-parallel-size): each --kv-events endpoint is rank 0's, and rank r "
        "publishes on its port + r, as vLLM offsets it",
    )  # fmt: skip
    parser.add_argument("--metrics-from-backends", action="store_true", help="poll each engine's /metrics")
    parser.add_argument("--ext-proc", type=_port, metavar="PORT", help="serve Envoy's ext_proc endpoint picker")
    parser.add_argument("--release-port", type=_port, metavar="PORT", help="UDP port for syslog release lines")
    parser.add_argument(
        "--accel-redirect",
        default="@prefixroute_upstream",
        metavar="LOCATION",
        help="nginx named location in X-Accel-Redirect (default @prefixroute_upstream)",
    )
    parser.add_argument(
        "--log-level", default="error", choices=["debug", "info", "warning", "error"],
        help="prefixroute's log level (default error: expired leases are counted in /metrics, not logged one by one)",
    )  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the sidecar from the options, bind its ports, serve until SIGINT/SIGTERM; return 0.

    Raises:
        ConfigurationError: a bad option (the CLI turns it into one line and exit status 2).
    """
    from prefixroute import Router, policy_from_name
    from prefixroute.adapters.serve.app import Sidecar
    from prefixroute.adapters.serve.text import PromptEncoder

    logging.basicConfig(format="prefixroute serve: %(levelname)s %(message)s")
    # uvicorn's loggers too (a malformed request's warning): its lines are the sidecar's, at the level asked for.
    for name in ("prefixroute", "uvicorn"):
        logging.getLogger(name).setLevel(args.log_level.upper())
    raise_open_files_limit()
    encoder = PromptEncoder(args.tokenizer) if args.tokenizer is not None else None
    # Each engine in the one spelling the sidecar routes with (a trailing "/" dropped), for --kv-events to match.
    backends = [check_backend_url(url, path=False) for url in args.backends]
    events = [_kv_events(spec, backends) for spec in args.kv_events]
    named = [backend for backend, _ in events]
    if len(set(named)) != len(named):  # not one silently dropped: which publisher is the right one?
        twice = next(backend for i, backend in enumerate(named) if backend in named[:i])
        raise ConfigurationError(f"--kv-events names backend {twice!r} twice: give each backend one ENDPOINT[,REPLAY]")
    if args.data_parallel_size is not None and not events:
        raise ConfigurationError("--data-parallel-size needs --kv-events: it says how many ranks publish per backend")
    options = [_policy_option(option) for option in args.policy_option]
    keys = [key for key, _ in options]
    if len(set(keys)) != len(keys):  # not one silently dropped: which value was meant?
        twice = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise ConfigurationError(f"--policy-option {twice} is given twice: give each option once")
    policy = policy_from_name(args.policy, **dict(options))
    fleet: Any = None
    if events or args.metrics_from_backends:
        from prefixroute.vllm import EventIndex, Fleet  # the serve extra includes the vllm one
        from prefixroute.vllm._checks import check_data_parallel_size

        if args.data_parallel_size is not None:  # before any port is bound: each rank is a thread and a socket
            check_data_parallel_size(args.data_parallel_size, "--data-parallel-size")
        index = EventIndex(args.block_size) if events else None
        router = Router(block_size=args.block_size, policy=policy, index=index)
        fleet = Fleet(router)
    else:
        router = Router(block_size=args.block_size, policy=policy)
    sidecar = Sidecar(
        router,
        backends=backends,
        encoder=encoder,
        models=args.models,
        lease=args.lease,
        healthy=fleet.healthy_backends if fleet is not None and args.metrics_from_backends else None,
        accel_redirect=args.accel_redirect,
        max_body_bytes=args.max_body_mib << 20,
    )
    # Whatever is refused below (a busy port, a malformed KV-event endpoint), what was bound or started before it is
    # released: main() may run in a process that goes on (a supervisor, a test).
    with contextlib.ExitStack() as cleanup:
        if fleet is not None:
            cleanup.callback(fleet.close)
        http_socket = cleanup.enter_context(_bind(socket.SOCK_STREAM, args.host, args.port))
        udp_socket = None
        if args.release_port is not None:
            udp_socket = cleanup.enter_context(_bind(socket.SOCK_DGRAM, args.host, args.release_port))
        if args.ext_proc:  # gRPC binds it itself, later: try it now, so a busy port is refused in our words alone
            _bind(socket.SOCK_STREAM, args.host, args.ext_proc, what="ext_proc").close()
        if args.models is None and backends:
            learner = BaseModelLearner(backends, lambda names: setattr(sidecar, "base_models", names))
            learner.start()
            cleanup.callback(learner.stop)
        if fleet is not None:
            by_backend = dict(events)
            for backend in backends:
                endpoints = by_backend.get(backend)
                fleet.add_backend(
                    backend,
                    kv_events=endpoints[0] if endpoints else None,
                    replay=endpoints[1] if endpoints else None,
                    metrics_url=backend if args.metrics_from_backends else None,
                    data_parallel_size=args.data_parallel_size if endpoints else None,
                )
        _run_loop(_serve(sidecar, http_socket, udp_socket, args))
    return 0


class BaseModelLearner:
    """Ask the backends' ``/v1/models`` for their base model, at start and every ``interval`` s until one answers.

    The base models are the cards without a ``parent`` (:func:`~prefixroute.adapters.serve.contract.base_model_names`).
    The names go to ``learned`` once, from a daemon thread; a backend that is down, slow (``timeout`` s) or answers
    garbage is skipped. Each backend is asked directly (no proxy from the environment, no redirect), as the gateway
    sends it requests. :meth:`stop` cuts a request in flight short: once it returns, ``learned`` is never called.
    """

    def __init__(
        self,
        backends: Sequence[str],
        learned: Callable[[frozenset[str]], None],
        *,
        interval: float = 10.0,
        timeout: float = 2.0,
    ) -> None:
        self._backends = tuple(backends)
        self._learned = learned
        self._interval = interval
        self._timeout = timeout
        self._stopped = threading.Event()
        # Held to call back and to stop, so that no call back begins once stop() has set _stopped; re-entrant, for a
        # learned that stops its learner.
        self._lock = threading.RLock()
        self._in_flight: set[socket.socket] = set()  # the connections of requests under way, for stop() to cut
        self._thread = threading.Thread(target=self._run, name="prefixroute-base-models", daemon=True)

    def start(self) -> None:
        """Start asking, on a thread of its own.

        Raises:
            StateError: it was started or stopped before (a learner runs once: make another).
        """
        with self._lock:
            if self._thread.ident is not None or self._stopped.is_set():
                raise StateError("a BaseModelLearner starts once, and not after stop(): make a new one")
            self._thread.start()

    def stop(self) -> None:
        """Stop asking: cut a request in flight short, and wait (at most ``timeout`` s, a connection still being
        opened) for the thread to end. Once it returns, ``learned`` is not called."""
        with self._lock:
            self._stopped.set()
            for sock in self._in_flight:
                with contextlib.suppress(OSError):  # closed meanwhile, or not connected yet
                    sock.shutdown(socket.SHUT_RDWR)  # a read blocked on it in the thread returns at once
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(self._timeout)

    def ask(self) -> frozenset[str] | None:
        """The base models of the backends that answered (None: none did). O(backends) requests."""
        from prefixroute.adapters.serve.contract import base_model_names  # the serve extra (msgspec): not at import

        names: set[str] = set()
        answered = False
        for backend in self._backends:
            if self._stopped.is_set():
                break
            try:
                cards = json.loads(self._models_of(backend)).get("data")
            except Exception:  # down, refusing, slow, cut short, not JSON, not an object: ask the next one
                continue
            if isinstance(cards, list):
                answered = True
                names |= base_model_names(cards)
        return frozenset(names) if answered else None

    def _models_of(self, backend: str) -> bytes:
        """The body of ``backend``'s ``/v1/models`` (the first 4 MiB); raise for anything but a 2xx answer."""
        url = urllib.parse.urlsplit(backend)
        https = url.scheme == "https"
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        # The port given, always: http.client would read the host "::1" as host ":" and port 1.
        connection = kind(url.hostname or "", url.port or (443 if https else 80), timeout=self._timeout)
        try:
            connection.connect()
            sock = connection.sock  # the response reads it on once a "Connection: close" answer has let it go
            with self._lock:
                if self._stopped.is_set():
                    raise ConnectionAbortedError("the learner was stopped")
                self._in_flight.add(sock)
            try:
                connection.request("GET", "/v1/models", headers={"Accept": "application/json"})
                with connection.getresponse() as reply:
                    if not 200 <= reply.status < 300:
                        raise ConnectionRefusedError(f"{backend}/v1/models answered HTTP {reply.status}")
                    return reply.read(2**22)
            finally:
                with self._lock:
                    self._in_flight.discard(sock)
        finally:
            connection.close()

    def _run(self) -> None:
        while not self._stopped.is_set():
            names = self.ask()
            if names is not None:
                with self._lock:
                    if self._stopped.is_set():  # stopped while it asked: learned nothing
                        return
                    _log.info("base models of the backends: %s", sorted(names))  # logged before they route
                    self._learned(names)
                return
            self._stopped.wait(self._interval)


def _http_server(sidecar: Any) -> Any:
    """uvicorn's server for the sidecar's HTTP endpoint, as ``prefixroute serve`` runs it (a ``uvicorn.Server``)."""
    import uvicorn

    from prefixroute.adapters._listening import close_listener

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGINT or SIGTERM only asks it to stop, and that its shutdown closes the
        listening sockets with :func:`close_listener` first.

        uvicorn's own signal handling re-raises the signal once it has stopped, which would kill the process (status
        143 for SIGTERM) before the listeners are closed in ``_serve``. uvicorn's own shutdown closes its servers and
        at once tells the connections it knows of to close: a connection accepted the loop turn before was lost
        unseen (CPython gh-109564), open until the garbage collector found it, and one accepted two turns before was
        never told, so the shutdown waited for its client to leave."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for listener in self.servers:
                await close_listener(listener)
            await super().shutdown(sockets)

    # No proxy-headers middleware, Server or Date header: each costs every request and a proxy needs none. No logging
    # configuration of uvicorn's own: its loggers go where the sidecar's go, at the level run() sets.
    config = uvicorn.Config(
        sidecar, http=_http_protocol(sidecar), lifespan="off", access_log=False, log_config=None, log_level=None,
        ws="none", timeout_keep_alive=75, backlog=4096, proxy_headers=False, server_header=False, date_header=False,
    )  # fmt: skip
    return Server(config)


async def _serve(sidecar: Any, http_socket: socket.socket, udp_socket: socket.socket | None, args: Any) -> None:
    from prefixroute.adapters.serve.release import ReleaseProtocol

    loop = asyncio.get_running_loop()
    transport = None
    grpc_server = None
    try:
        # Every listener is bound before any is announced: a failure leaves nothing on stdout.
        if udp_socket is not None:
            transport, _ = await loop.create_datagram_endpoint(lambda: ReleaseProtocol(sidecar), sock=udp_socket)
        if args.ext_proc is not None:
            from prefixroute.adapters.serve.ext_proc import start_ext_proc

            try:
                grpc_server, port = await start_ext_proc(sidecar, args.host, args.ext_proc)
            except (OSError, RuntimeError) as exc:
                where = host_port(args.host, args.ext_proc)
                raise ConfigurationError(f"cannot listen for ext_proc on {where}: {exc}") from None
        server = _http_server(sidecar)
        if udp_socket is not None:
            _say(f"release listener on udp://{_address(udp_socket)}")
        if grpc_server is not None:
            _say(f"ext_proc endpoint picker on {host_port(args.host, port)}")
        count = len(sidecar.backends)
        backends = f"{count} backend{'' if count == 1 else 's'}"
        _say(f"http://{_address(http_socket)} ({backends}, policy {sidecar.router.policy!r})")
        # What start-up made (modules, the tokenizer, gRPC) lives as long as the process: move it out of the
        # collector's reach, so a full collection under load walks only what serving made (ms less per pause).
        gc.collect()
        gc.freeze()
        await server.serve(sockets=[http_socket])
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        if transport is not None:
            transport.close()


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the serve extra, absent on Windows
        asyncio.run(main)
        return
    uvloop.run(main)


_MAX_HEAD_BYTES = 64 * 2**10
"""The largest request head (its line and headers) the sidecar reads; past it, a 431 (nginx takes 32 KiB, aiohttp
8 KiB a line)."""
_READ_TIMEOUT_S = 60.0
"""How long a request may go without a byte before its connection is closed (nginx's client_header_timeout and
client_body_timeout)."""

# poll() events that say the peer closed: its FIN (POLLRDHUP, Linux), both directions shut, or an error (a reset)
_CLOSED = (getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR) if hasattr(select, "poll") else None


def _http_protocol(sidecar: Any) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools, else h11), except that a request its parser refuses (a malformed chunk
    size, a Content-Length given twice or beside chunked, no HTTP at all) is answered as the sidecar answers bad
    input: a 400 with ``{"error": ...}`` in JSON, counted in ``prefixroute_bad_requests_total``, where uvicorn
    answers a line of text/plain. The connection is closed after it, as uvicorn does: its framing is lost.

    A request that asks to upgrade its connection (``Upgrade: h2c``, as ``curl --http2`` and Java's HttpClient send
    by default; ``websocket``) is served as plain HTTP/1.1, as RFC 9110 §7.8 lets a server do: httptools ends such a
    request at its head and uvicorn answered it without its body (a 400 "truncated" for every request of those
    clients) and logged two warnings. A head over :data:`_MAX_HEAD_BYTES` is a 431 (counted in chunks read whole
    within one head: a pipelining client's head that shares a chunk with the request before it is counted from the
    next chunk on), and a connection whose request goes :data:`_READ_TIMEOUT_S` without a byte is closed (not while
    the server holds it back). With h11 (no httptools) neither: h11 caps a head at 16 KiB itself."""
    from prefixroute.adapters.serve.app import CLIENT_LEFT

    base: Any
    use_httptools = _http_impl() == "httptools"
    if use_httptools:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    else:  # pragma: no cover - httptools is in the serve extra
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol

    class Protocol(base):  # type: ignore[misc]
        if use_httptools:
            parser: Any
            _head = 0  # bytes received of a request head still incomplete; -1 while a body is read
            _headed = False  # a head was completed by the chunk being fed
            _reading = True  # a request is incomplete (or none has begun since the connection opened)
            _last_read = 0.0  # the loop's time of the last bytes received
            _watch: asyncio.TimerHandle | None = None

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                self._last_read = self.loop.time()
                self._watch = self.loop.call_later(_READ_TIMEOUT_S, self._check_reading)

            def connection_lost(self, exc: Exception | None) -> None:
                if self._watch is not None:
                    self._watch.cancel()
                super().connection_lost(exc)

            def _check_reading(self) -> None:
                """Close a connection whose request has not come whole, with nothing received for
                :data:`_READ_TIMEOUT_S` (nginx's client_header_timeout and client_body_timeout): uvicorn times out
                only a connection idle after an answer, so a client that never finished its head or body held its
                connection for ever."""
                if self.transport.is_closing():
                    return
                if self.flow.read_paused:  # the server holds the client back (a pipelined request waits): not idle
                    self._last_read = self.loop.time()
                idle = self.loop.time() - self._last_read
                if self._reading and idle >= _READ_TIMEOUT_S:
                    self.transport.close()
                    return
                delay = _READ_TIMEOUT_S - idle if self._reading else _READ_TIMEOUT_S  # idle after an answer: uvicorn's
                self._watch = self.loop.call_later(max(delay, 0.01), self._check_reading)

            def on_headers_complete(self) -> None:
                self._head = -1
                self._headed = True
                super().on_headers_complete()

            def on_message_complete(self) -> None:
                self._reading = False
                self._head = 0  # what comes next is the next request's head
                super().on_message_complete()

            def _should_upgrade(self) -> bool:
                # Any upgrade asked for, so that uvicorn starts nothing for its head (see data_received); not a CONNECT.
                return bool(self._get_upgrade())

            def data_received(self, data: bytes) -> None:  # uvicorn's, but for an upgrade and a head's size
                self._unset_keepalive_if_required()
                self._last_read = self.loop.time()
                in_head, self._headed = self._head >= 0, False  # a chunk all head: in one before, none completed
                try:
                    self.parser.feed_data(data)
                except httptools.HttpParserError:
                    self.logger.warning("Invalid HTTP request received.")
                    self.send_400_response("")
                    return
                except httptools.HttpParserUpgrade as upgrade:
                    self._upgrade(data, upgrade.args[0])
                    return
                if in_head and not self._headed:  # httptools takes a head of any size (64 MiB: 2.8 s of CPU)
                    self._head += len(data)
                    if self._head > _MAX_HEAD_BYTES:
                        self._refuse(431, b"Request Header Fields Too Large",
                                     f"the request's head is over {_MAX_HEAD_BYTES} bytes: send fewer or "
                                     "shorter headers")  # fmt: skip

            def _upgrade(self, data: bytes, offset: int) -> None:
                """A request that asks to upgrade (its head ends at ``offset`` of ``data``): served as HTTP/1.1."""
                if not self._should_upgrade():  # a CONNECT: answered by the app, the rest ignored, as uvicorn
                    self._unsupported_upgrade_warning()
                    return
                # Parse the request again from a head without the upgrade, then what followed it (its body).
                head = [self.parser.get_method(), b" ", self.url, b" HTTP/", self.parser.get_http_version().encode()]
                for name, value in self.headers:
                    if name == b"connection":
                        value = b",".join(t for t in value.split(b",") if t.strip().lower() != b"upgrade")
                    if name != b"upgrade" and (name != b"connection" or value.strip()):
                        head += [b"\r\n", name, b": ", value]
                self.parser = httptools.HttpRequestParser(self)
                with contextlib.suppress(AttributeError):  # as uvicorn makes its own (httptools 0.6.3 and later)
                    self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
                self.data_received(b"".join(head) + b"\r\n\r\n" + data[offset:])

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._reading = True
            self.scope["extensions"] = {**(self.scope.get("extensions") or {}), CLIENT_LEFT: self.client_left}

        def client_left(self) -> bool:
            """Whether the client has closed its connection (its FIN or a reset waits in the socket, or the server
            has read it), without reading from it: one poll(2), ~1.6 us."""
            if self.transport.is_closing():
                return True
            sock = self.transport.get_extra_info("socket")
            if sock is None or _CLOSED is None:  # pragma: no cover - POLLRDHUP is Linux's
                return False
            poller = select.poll()
            poller.register(sock.fileno(), _CLOSED)
            return any(events & _CLOSED for _fd, events in poller.poll(0))

        def send_400_response(self, msg: str) -> None:
            error = ("the request is not valid HTTP/1.1: send one request line, headers, and a body framed by one "
                     "Content-Length or by well-formed chunks")  # fmt: skip
            self._refuse(400, b"Bad Request", error)

        def _refuse(self, status: int, reason: bytes, error: str) -> None:
            """Answer a request refused before the app saw it, in the sidecar's JSON, counted; close: its framing is
            lost."""
            sidecar.metrics.refused(status)
            body = json.dumps({"error": error}, separators=(",", ":")).encode()  # as the sidecar's own answers
            head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head.append(
                b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            )
            self.transport.write(b"".join(head) + body)
            self.transport.close()

    return Protocol


def _http_impl() -> str:
    try:
        import httptools  # noqa: F401
    except ImportError:  # pragma: no cover
        return "h11"
    return "httptools"


def _bind(kind: int, host: str, port: int, *, what: str | None = None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, kind)
    try:
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if kind == socket.SOCK_STREAM:
            sock.listen(4096)
    except OSError as exc:
        sock.close()
        what = what or ("HTTP" if kind == socket.SOCK_STREAM else "UDP")
        raise ConfigurationError(f"cannot listen ({what}) on {host_port(host, port)}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return host_port(host, port)


def _say(line: str) -> None:
    announce(f"prefixroute serve: {line}")


def _kv_events(spec: str, backends: list[str]) -> tuple[str, tuple[str, str | None]]:
    backend, sep, endpoints = spec.partition("=")
    if not sep or not backend or not endpoints:
        raise ConfigurationError(f"--kv-events takes BACKEND=ENDPOINT[,REPLAY], like "
                                 f"http://gpu0:8000=tcp://gpu0:5557, not {spec!r}")  # fmt: skip
    named = backend.rstrip("/")  # as check_backend_url reads --backends
    try:  # one engine however it is spelt (HTTP://GPU0, gpu0:80), as --backends finds one listed twice
        engine = engine_of(check_backend_url(named))
        backend = next(b for b in backends if engine_of(b) == engine)
    except (ConfigurationError, StopIteration):
        raise ConfigurationError(
            f"--kv-events names backend {named!r}, which is not one of --backends {backends}"
        ) from None
    publisher, _, replay = endpoints.partition(",")
    return backend, (publisher, replay or None)


_FLAG_VALUES: Mapping[str, bool] = MappingProxyType({"true": True, "false": False})


def _policy_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as the policy's keyword: an int, a float, ``true``/``false`` (any case) a bool, else the text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ConfigurationError(f"--policy-option takes KEY=VALUE, like factor=1.5, not {text!r}")
    if value.lower() in _FLAG_VALUES:  # a flag (PredictedTTFT's use_speed) takes only a bool
        return key, _FLAG_VALUES[value.lower()]
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, not {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, not {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, not {text!r}")
    return value


if __name__ == "__main__":  # pragma: no cover
    from prefixroute.cli import main

    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(["serve", *sys.argv[1:]]))
