"""Run an asyncio server on a thread of its own, with its own event loop: for tests, examples and notebooks.

:class:`~prefixroute.adapters.proxy.Proxy` and the fake OpenAI engine of :mod:`prefixroute.testing` serve through it
when started with ``start()`` (or as context managers) instead of awaiting their ``serve()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

CoroutineFunction = Callable[[], Awaitable[object]]

__all__ = ["ServerThread"]


class ServerThread:
    """``serve()`` (which starts listening and returns) on a new thread's event loop, until :meth:`stop` awaits
    ``close()`` there. :meth:`start` returns once listening, or raises what ``serve()`` raised."""

    def __init__(self, serve: CoroutineFunction, close: CoroutineFunction, *, name: str) -> None:
        self._serve = serve
        self._close = close
        self._name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._stopping = threading.Lock()  # stop() from several threads: one stops, the others wait for it

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The thread's event loop while it serves, else None."""
        return self._loop

    def is_current(self) -> bool:
        """Whether the calling code runs on this server's thread."""
        return threading.current_thread() is self._thread

    def start(self) -> None:
        """Start the thread and wait until ``serve()`` returned. Raises what it raised (the thread then ends)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            try:
                await self._serve()
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                ready.set()
                return
            self._loop = asyncio.get_running_loop()
            self._stopped = asyncio.Event()
            ready.set()
            await self._stopped.wait()
            await self._close()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name=self._name, daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self) -> None:
        """Await ``close()`` on the thread and join it (10 s at most). Idempotent, also from several threads."""
        with self._stopping:
            if self._thread is not None and self._loop is not None and self._stopped is not None:
                self._loop.call_soon_threadsafe(self._stopped.set)
                self._thread.join(10)
            self._thread = self._loop = self._stopped = None
