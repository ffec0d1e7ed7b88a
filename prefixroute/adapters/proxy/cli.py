"""``prefixroute proxy``: build a :class:`~prefixroute.adapters.proxy.Proxy` from command-line options and serve."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import signal
import socket
from typing import Any

from prefixroute._numbers import shown
from prefixroute.adapters._listening import raise_open_files_limit
from prefixroute.adapters.proxy.app import MAX_BODY_BYTES, MAX_RETRIES, Proxy
from prefixroute.adapters.proxy.prompts import PromptEncoding
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.adapters.urls import listen_host
from prefixroute.cli import MAX_BODY_MIB, announce, body_mib
from prefixroute.errors import ConfigurationError
from prefixroute.policies import policy_from_name, policy_names
from prefixroute.router import Router

__all__ = ["build", "register", "run"]


def register(subparsers: Any) -> None:
    """Add the ``proxy`` subcommand to the ``prefixroute`` CLI."""
    parser = subparsers.add_parser(
        "proxy",
        help="an OpenAI-compatible, prefix-aware router in front of vLLM servers",
        description="Serve /v1/completions and /v1/chat/completions (streamed or not), /v1/models, /metrics and "
        "/healthz, sending each request to the vLLM backend that holds its prompt's prefix, within the policy's "
        "load bound.",
    )
    parser.add_argument("--backends", nargs="+", required=True, metavar="URL",
                        help="base URLs of the vLLM OpenAI servers, e.g. http://gpu0:8000")  # fmt: skip
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="the model's local folder (tokenizer.json, and the chat template from "
                        "tokenizer_config.json or chat_template.jinja) or its tokenizer.json, to route text and chat "
                        "on the engine's token ids; without it text routes on its bytes")  # fmt: skip
    parser.add_argument("--base-model", nargs="+", metavar="NAME",
                        help="the backends' base model name(s); requests naming any other model (LoRA adapters) "
                        "route apart. Default: learned from the backends' /v1/models")  # fmt: skip
    parser.add_argument(
        "--policy",
        default="predicted-ttft",
        help=f"one of {', '.join(policy_names())}, or a policy class of yours as package.module:ClassName "
        "(default predicted-ttft, the library's)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM's block size, 16)")
    parser.add_argument("--kv-events", nargs="+", metavar="ENDPOINT",
                        help="per backend, in --backends order, its KV-event publisher (tcp://gpu0:5557), "
                        "optionally ',REPLAY' (tcp://gpu0:5557,tcp://gpu0:5558): the index follows what the "
                        "engines really cache")  # fmt: skip
    parser.add_argument("--data-parallel-size", type=int, metavar="N",
                        help="engines per backend (vLLM's --data-parallel-size): each --kv-events endpoint is "
                        "rank 0's, and rank r publishes on its port + r, as vLLM offsets it")  # fmt: skip
    parser.add_argument("--metrics-from-backends", action="store_true",
                        help="read each backend's /metrics: its queue and KV usage feed the policy, failed "
                        "scrapes take it out of rotation")  # fmt: skip
    parser.add_argument("--retries", type=int, default=1,
                        help=f"resends after a refused connection, 0 to {MAX_RETRIES} (1)")  # fmt: skip
    parser.add_argument("--max-failures", type=int, default=3, metavar="N",
                        help="failures in a row (unreachable, a 5xx answer, an answer broken off) that take a "
                        "backend out of rotation for --cooldown (3)")  # fmt: skip
    parser.add_argument("--cooldown", type=float, default=10.0, metavar="SECONDS",
                        help="how long a failing backend stays out of rotation, unless it answers whole a request "
                        "sent while it was out (every backend out: all are tried) (10)")  # fmt: skip
    parser.add_argument("--connect-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="the longest wait to open a connection to a backend before the request is committed "
                        "to the next (2)")  # fmt: skip
    parser.add_argument("--models-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="the longest wait for a backend's /v1/models, the connection included (2)")  # fmt: skip
    parser.add_argument("--max-body-mib", type=body_mib, default=MAX_BODY_BYTES >> 20, metavar="MIB",
                        help=f"the largest request body taken, 1 to {MAX_BODY_MIB} MiB (64); larger ones are "
                        "answered 413. vLLM reads any size: raise it for prompts of millions of tokens or large "
                        "inline images")  # fmt: skip
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="prefixroute's log level (default warning: a backend leaving the rotation, a stream "
                        "broken off, a failing scrape)")  # fmt: skip
    parser.add_argument("--host", type=listen_host, default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.set_defaults(func=run)


def build(args: argparse.Namespace, *, check_port: bool = False) -> tuple[Proxy, Any]:
    """The proxy the options describe, and the :class:`~prefixroute.vllm.Fleet` it needs (None without one).

    With ``check_port``, ``--host`` and ``--port`` are tried before the fleet starts polling (the other options
    checked first): a busy port is then the command's one line on stderr, not one after the warnings of a backend
    down.

    Raises:
        ConfigurationError: options that do not fit together (the message says which), or, with ``check_port``, an
            address that cannot be listened on.
    """
    if not 0 <= args.retries <= MAX_RETRIES:  # before a tokenizer is read or a fleet started
        raise ConfigurationError(f"--retries must be an int in [0, {MAX_RETRIES}], not {shown(args.retries)}")
    if args.max_failures < 1:
        raise ConfigurationError(f"--max-failures must be an int >= 1, not {args.max_failures}")
    for option in ("cooldown", "connect_timeout", "models_timeout"):
        seconds = getattr(args, option)
        if not (math.isfinite(seconds) and seconds > 0):
            flag = "--" + option.replace("_", "-")
            raise ConfigurationError(f"{flag} must be a positive, finite number of seconds, not {shown(seconds)}")
    policy = policy_from_name(args.policy)
    encoder: PromptEncoding | None = None if args.tokenizer is None else PromptEncoder(args.tokenizer)
    options: dict[str, Any] = {"encoder": encoder, "retries": args.retries, "base_models": args.base_model,
                               "max_failures": args.max_failures, "cooldown": args.cooldown,
                               "connect_timeout": args.connect_timeout, "models_timeout": args.models_timeout,
                               "max_body_bytes": args.max_body_mib << 20}  # fmt: skip
    backends = [url.rstrip("/") for url in args.backends]
    kv_events = args.kv_events or []
    if kv_events and len(kv_events) != len(backends):
        raise ConfigurationError(
            f"--kv-events names {len(kv_events)} endpoints for {len(backends)} backends: give one per backend, "
            "in --backends order"
        )
    if args.data_parallel_size is not None and not kv_events:
        raise ConfigurationError("--data-parallel-size needs --kv-events: it says how many ranks publish per backend")
    if args.data_parallel_size is not None:  # each rank is a subscriber thread and a socket
        from prefixroute.vllm._checks import check_data_parallel_size

        check_data_parallel_size(args.data_parallel_size, "--data-parallel-size")
    if kv_events and encoder is None:
        raise ConfigurationError("--kv-events needs --tokenizer: KV events carry token ids, text must route on them")
    if not (kv_events or args.metrics_from_backends):
        router = Router(block_size=args.block_size, policy=policy)
        return Proxy(router, backends, **options), None
    from prefixroute.vllm import EventIndex, Fleet

    index = EventIndex(args.block_size) if kv_events else None
    router = Router(block_size=args.block_size, policy=policy, index=index)
    fleet = Fleet(router)
    try:
        proxy = Proxy(router, backends, fleet=fleet, **options)  # checks its options before the fleet starts
        if check_port:
            try:
                _try_listen(args.host, args.port)
            except OSError as exc:
                raise ConfigurationError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
        for i, backend in enumerate(backends):
            publisher, _, replay = kv_events[i].partition(",") if kv_events else ("", "", "")
            if kv_events and not publisher:
                raise ConfigurationError(f"--kv-events gives no endpoint for {backend}: give tcp://HOST:PORT")
            fleet.add_backend(
                backend,
                kv_events=publisher or None,
                replay=replay or None,
                metrics_url=backend if args.metrics_from_backends else None,
                data_parallel_size=args.data_parallel_size if publisher else None,
            )
    except BaseException:
        fleet.close()
        raise
    return proxy, fleet


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; return the exit status (0 once stopped)."""
    if not 0 <= args.port < 65536:
        raise ConfigurationError(f"--port must be a port number, not {args.port}")
    logging.basicConfig(format="prefixroute proxy: %(levelname)s %(message)s")
    logging.getLogger("prefixroute").setLevel(args.log_level.upper())
    raise_open_files_limit()
    proxy, fleet = build(args, check_port=True)

    async def serve() -> None:
        url = await proxy.serve(host=args.host, port=args.port)
        # SIGTERM (systemd, Docker, Kubernetes) stops it as Ctrl-C does: connections and the fleet closed, status 0.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (ValueError, RuntimeError):  # not the main thread: left to the caller
                continue
            handled.append(sig)
        count = len(proxy.backends)
        try:
            announce(f"prefixroute proxy at {url}, routing to {count} backend{'' if count == 1 else 's'}")
            await stop.wait()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            await proxy.aclose()

    try:
        _run(serve())
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        raise ConfigurationError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    finally:
        if fleet is not None:
            fleet.close()
    return 0


def _try_listen(host: str, port: int) -> None:
    """Bind every address of ``host`` on ``port`` as the proxy's server will, and let go (a busy port, a host that does
    not resolve or is not this machine's raise OSError). Port 0 is any free port: nothing to try."""
    if port == 0:
        return
    unavailable: OSError | None = None
    bound = False
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):  # fmt: skip
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server(reuse_address)
            if family == socket.AF_INET6:  # as asyncio binds each family apart
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:  # an address family the machine lacks: newer asyncio skips it, so here too
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                unavailable = exc
            else:
                bound = True
    if unavailable is not None and not bound:  # no address is this machine's: asyncio fails too, so say it now
        raise unavailable


def _run(main: Any) -> None:
    """Run on uvloop when it is installed (less CPU per proxied request), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)
