"""The fire-and-forget release path: a UDP listener for the syslog lines proxies write when a request ends.

nginx and HAProxy write their access log when a request is over (its response sent, failed, or the client gone), and
both can send it as a syslog datagram. A log format carrying ``prefixroute_finish=<id>`` turns that line into the
release of the decision: exactly at the end of the stream, with nothing on the request's path. Any text may
surround the token (syslog headers, other fields); ``prefixroute_first_token=<id>`` is read too. A ``status=<code>``
field on the same line that is a refusal (:func:`~prefixroute.adapters.serve.contract.is_refusal`: a 4xx but a
timeout or nginx's 499) finishes the request refused, so the router forgets the blocks it predicted there; the
example configurations log it. A lost datagram is covered by the request's lease; one that holds no token (junk, or
a log format that lacks it) is counted in ``prefixroute_release_datagrams_unread_total``. A line's first 16 tokens
are read (a log line carries one or two). The listener trusts
whoever can reach it: bind it to loopback.

>>> release_ids(b"<190>nginx: prefixroute_finish=ab12-3f status=200")
[('finish', 'ab12-3f')]
"""

from __future__ import annotations

import asyncio
import logging
import re

from prefixroute.adapters.serve.app import Sidecar
from prefixroute.adapters.serve.contract import is_refusal
from prefixroute.errors import InvalidTypeError

__all__ = ["ReleaseProtocol", "refused", "release_ids"]

_log = logging.getLogger(__name__)
_TOKEN = re.compile(rb"prefixroute_(finish|first_token)=([0-9A-Za-z_.:-]+)")
_TOKENS_PER_LINE = 16  # a gateway's log line carries one or two; the rest of a line holding more is not read
_STATUS = re.compile(rb"(?<![0-9A-Za-z_])status=([0-9]{3})(?![0-9])")


def release_ids(datagram: bytes) -> list[tuple[str, str]]:
    """``(what, decision id)`` for each release token in a log line, in order. O(len(datagram)).

    Raises:
        TypeError: ``datagram`` is not bytes.
    """
    if not isinstance(datagram, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"datagram must be bytes, not {type(datagram).__name__}")
    return [(what.decode(), decision_id.decode()) for what, decision_id in _TOKEN.findall(datagram)]


def refused(line: bytes) -> bool:
    """Whether a log line's ``status=<code>`` says the engine refused the request (see the module's docstring). O(n).

    >>> refused(b"prefixroute_finish=ab12-3f status=400"), refused(b"prefixroute_finish=ab12-3f status=499")
    (True, False)

    Raises:
        TypeError: ``line`` is not bytes.
    """
    if not isinstance(line, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"line must be bytes, not {type(line).__name__}")
    found = _STATUS.search(line)
    return found is not None and is_refusal(int(found.group(1)))


class ReleaseProtocol(asyncio.DatagramProtocol):
    """Apply every release token of every datagram to ``sidecar`` (a ``-`` id, nginx's empty value, is skipped); count
    a datagram without any in the sidecar's metrics (``prefixroute_release_datagrams_unread_total``).

    Raises:
        TypeError: ``sidecar`` is not a :class:`~prefixroute.adapters.serve.Sidecar`.
    """

    def __init__(self, sidecar: Sidecar) -> None:
        if not isinstance(sidecar, Sidecar):
            raise InvalidTypeError(f"ReleaseProtocol takes a Sidecar, not {type(sidecar).__name__}")
        self._sidecar = sidecar

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        read = False
        for line in data.splitlines():  # one log line a datagram as syslog sends it; several are read line by line
            was_refused: bool | None = None  # the line's status, read once (it was once per token: a line of
            # thousands of tokens, anyone's datagram, held the sidecar's loop for seconds)
            for what, decision_id in release_ids(line)[:_TOKENS_PER_LINE]:
                read = True
                if decision_id == "-":
                    continue
                if what == "finish":
                    if was_refused is None:
                        was_refused = refused(line)
                    self._sidecar.finish(decision_id, via="udp", refused=was_refused)
                else:
                    self._sidecar.first_token(decision_id, via="udp")
        if not read:  # junk, or a log format without the token: counted, so it shows before the leases expire
            self._sidecar.metrics.unread()

    def error_received(self, exc: Exception) -> None:  # ICMP noise on a UDP socket (a port unreachable)
        _log.debug("release listener: %s", exc)
