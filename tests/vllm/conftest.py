"""Shared helpers for the vLLM integration tests: real sockets on 127.0.0.1, waits with a deadline."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefixroute import Router
from prefixroute.testing import FakeVLLM
from prefixroute.vllm import EventIndex, KVEventSubscriber

from ..conftest import wait_until


def events_router(**options: object) -> Router:
    """A router whose index only KV events write (no speculative entries)."""
    return Router(index=EventIndex(16, speculative_ttl=0), **options)  # type: ignore[arg-type]


def fresh() -> list[int]:
    """A prompt no other prompt shares, so completing it always publishes a batch."""
    return [random.randrange(100_000, 2**31) for _ in range(16)]


def settle(engine: FakeVLLM, sub: KVEventSubscriber) -> None:
    """Publish fresh batches until the subscriber has applied the latest one.

    A fresh batch reveals a trailing loss as a gap, and republishing covers a SUB socket that was still connecting
    (a PUB socket drops what it sends before then) and a pending :meth:`FakeVLLM.drop_next`.
    """
    state = {"published_at": 0.0}

    def caught_up() -> bool:
        if sub.last_seq == engine.seq - 1 and state["published_at"]:
            return True
        if time.monotonic() - state["published_at"] > 0.25:
            engine.complete(fresh())
            state["published_at"] = time.monotonic()
        return False

    wait_until(caught_up, what="the subscriber to apply the engine's latest batch")


SMALL_BODY = b'vllm:num_requests_waiting{engine="0"} 3\nvllm:num_requests_running{engine="0"} 1\n'
"""A /metrics body with two figures."""


def answer(body: bytes, *headers: str) -> bytes:
    """An HTTP/1.1 200 answer carrying ``body``, which keeps the connection open."""
    head = [f"Content-Length: {len(body)}", "Content-Type: text/plain; version=0.0.4", *headers]
    return ("HTTP/1.1 200 OK\r\n" + "".join(f"{line}\r\n" for line in head) + "\r\n").encode() + body


@contextmanager
def http_server(answers: Callable[[int], bytes | None]) -> Iterator[tuple[str, list[socket.socket]]]:
    """An HTTP/1.1 server on loopback that keeps each connection open for further requests: it answers the n-th
    request it receives (counted over all connections) with ``answers(n)``, or with a status line and then a byte of a
    header every 20 ms (until the client goes) when that is None. Yields the /metrics URL and the connections it
    accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    accepted: list[socket.socket] = []
    requests = iter(range(1 << 30))

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while not stop.is_set():
                    received = b""
                    while b"\r\n\r\n" not in received:
                        data = conn.recv(65536)
                        if not data:
                            return
                        received += data
                    reply = answers(next(requests))
                    if reply is not None:
                        conn.sendall(reply)
                        continue
                    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    while not stop.is_set():
                        conn.sendall(b"a")
                        stop.wait(0.02)
            except OSError:  # the client shut the connection down
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/metrics", accepted
    finally:
        stop.set()
        server.close()
