"""Close a listening asyncio server without losing a connection it accepted just before: every server here uses it.

The proxy, the sidecar (under uvicorn) and the fake OpenAI engine close their listening sockets while clients may
still connect; :func:`close_listener` is the one way they do it. :func:`raise_open_files_limit` is what the servers'
commands do first, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["close_listener", "raise_open_files_limit"]

_OPEN_FILES_WANTED = 65536


def raise_open_files_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit, at most 65,536, as vLLM's server does at start
    (``set_ulimit``): each connection a server holds is a descriptor (two for a proxied one), and a common soft
    limit of 1,024 would stop a proxy at about 500 streams. For the commands only: a library leaves its host's limits
    alone. Where the limit cannot be read or raised (no ``resource`` module, a container's seccomp), it stays."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = _OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, _OPEN_FILES_WANTED)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, OSError, ValueError):  # pragma: no cover - Windows, or a limit this process may not change
        return


async def close_listener(server: asyncio.Server) -> None:
    """Stop ``server`` accepting, let the connections it accepted so far register with their protocol, then close it.

    asyncio gives an accepted connection its transport a loop turn after accepting it, and calls the protocol's
    ``connection_made`` a turn after that. A server closed in the first gap fails the transport unseen (CPython
    gh-109564: ``Server._attach`` asserts, ``_accept_connection2`` swallows it), so the connection stays open, neither
    served nor closed, until the garbage collector finds it, and a client that sent a request on it waits that long;
    one closed in the second gap leaves a connection that the web server's shutdown, run next, does not know of
    (aiohttp waits a turn for it, uvicorn does not). When this returns, every connection the server accepted has its
    transport and is known to the web server (aiohttp's ``Server.connections``, uvicorn's ``server_state``), which
    can close it or let its request finish; connections still in the listening socket's backlog are refused.

    It takes two loop turns. Idempotent: a closed server is closed again at no cost.

    Portability: it stops accepting with ``loop.remove_reader``. A loop without readers (Windows' proactor loop)
    cannot stop accepting that way: the server is then closed at once and the same turns still pass, so the second
    gap is covered, but a connection accepted in the turn it closes may be left open there until garbage collection
    (the CPython bug). uvloop gives a connection its transport as it accepts it (the first gap does not exist there):
    its ``remove_reader`` leaves the listener alone, and the turns cover the second gap.
    """
    loop = asyncio.get_running_loop()
    for sock in server.sockets:
        with contextlib.suppress(NotImplementedError):  # the proactor loop (Windows) has no readers
            loop.remove_reader(sock.fileno())
    await asyncio.sleep(0)  # the connections accepted so far get their transports while the server is open
    server.close()
    await asyncio.sleep(0)  # and their connection_made, which registers them with the web server
