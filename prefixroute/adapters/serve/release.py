"""The fire-and-forget release path: a UDP listener for the syslog lines proxies write when a request ends.

nginx and HAProxy write their access log when a request is over (its response sent, failed, or the client gone), and
both can send it as a syslog datagram. A log format carrying ``prefixroute_finish=<id>`` turns that line into the
release of the decision: exactly at the end of the stream, with nothing on the request's path. Any text may
surround the token (syslog headers, other fields); ``prefixroute_first_token=<id>`` is read too. A lost datagram is
covered by the request's lease. The listener trusts whoever can reach it: bind it to loopback.

>>> release_ids(b"<190>nginx: prefixroute_finish=ab12-3f status=200")
[('finish', 'ab12-3f')]
"""

from __future__ import annotations

import asyncio
import logging
import re

from prefixroute.adapters.serve.app import Sidecar

__all__ = ["ReleaseProtocol", "release_ids"]

_log = logging.getLogger(__name__)
_TOKEN = re.compile(rb"prefixroute_(finish|first_token)=([0-9A-Za-z_.:-]+)")


def release_ids(datagram: bytes) -> list[tuple[str, str]]:
    """``(what, decision id)`` for each release token in a log line, in order. O(len(datagram))."""
    return [(what.decode(), decision_id.decode()) for what, decision_id in _TOKEN.findall(datagram)]


class ReleaseProtocol(asyncio.DatagramProtocol):
    """Apply every release token of every datagram to ``sidecar`` (a ``-`` id, nginx's empty value, is skipped)."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        for what, decision_id in release_ids(data):
            if decision_id == "-":
                continue
            if what == "finish":
                self._sidecar.finish(decision_id, via="udp")
            else:
                self._sidecar.first_token(decision_id, via="udp")

    def error_received(self, exc: Exception) -> None:  # pragma: no cover - ICMP noise on a UDP socket
        _log.debug("release listener: %s", exc)
