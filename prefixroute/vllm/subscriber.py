"""Subscribe to one vLLM engine's KV-cache events and keep a router's index exact.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv@gpu0@llama"}'``) publishes on a ZMQ PUB socket messages of three
frames: topic, an 8-byte big-endian sequence number and a msgpack ``EventBatch``. A ROUTER socket replays buffered
messages: a DEALER sends ``[b"", start_seq]`` and receives ``[b"", seq, payload]`` frames (``[b"", topic, seq,
payload]`` from vLLM >= 0.26) until ``seq == -1``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import xxhash
import zmq
from zmq.utils.monitor import parse_monitor_message

from prefixroute._numbers import as_float, shown
from prefixroute.errors import ConfigurationError, InvalidEventError, InvalidTypeError, StateError
from prefixroute.vllm._checks import (
    MAX_SECONDS,
    check_backend,
    check_callable,
    check_count,
    check_endpoint,
    check_seconds,
    sparse_level,
)
from prefixroute.vllm.events import EventDecoder
from prefixroute.vllm.tracker import BlockTracker, IndexOps, IndexWriter, TrackerStats, check_writer

__all__ = ["KVEventSubscriber", "SubscriberStats"]

_log = logging.getLogger(__name__)
_LATEST = 2**62  # replay "to the end of the buffer"
_END_OF_REPLAY = -1
MAX_REPLAY_BATCHES = 100_000
"""The most batches one replay keeps: an endpoint that never stops answering cannot grow the replies without bound."""
MAX_MESSAGE_BYTES = 128 * 2**20
"""The largest frame the event and replay sockets take: libzmq drops the connection of a peer that sends a larger one
before reading it into memory (the event socket is then made again; a replay is cut short, a failed replay). vLLM's
largest batches, a step that stores the blocks of a million-token prompt, are under 8 MiB."""
_STOP_POLL_MS = 50  # how often a waiting thread looks whether stop() was called
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_WATCHED = (
    zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
    | _HANDSHAKE_FAILED
)  # fmt: skip
_ABANDONED_S = 1.0  # libzmq schedules a reconnect as it drops a connection: one not scheduled by then never is


class _Abandoned(Exception):
    """libzmq dropped the connection to the endpoint and will not reconnect: a peer that broke ZMQ's protocol."""


class _Link:
    """The SUB socket's connection as its monitor tells it."""

    def __init__(self) -> None:
        self.handshaking = False  # connected, the ZMQ handshake not yet done
        self.up = False  # a ZMQ session with the publisher: handshake done, not disconnected since
        self.failed_in_a_row = 0  # handshakes failed since the last that succeeded
        self.dropped_at: float | None = None  # dropped, and no reconnect scheduled since


@dataclass(frozen=True)
class SubscriberStats:
    """A snapshot of a subscriber's counters (see :meth:`KVEventSubscriber.stats`)."""

    backend: str
    last_seq: int
    batches: int
    """The engine's batches applied to the index, live or from a replay, each counted once: one that a replay after
    :meth:`~KVEventSubscriber.reset` applies again (numbered at most the last one counted before the reset) is
    counted in ``replayed_batches`` only."""
    events: int
    """The events of the batches counted in ``batches``."""
    gaps: int
    replayed_batches: int
    """Batches applied from the replay endpoint: a gap filled, a catch-up at start or after a reconnect, or the
    replay after :meth:`~KVEventSubscriber.reset`."""
    unrecovered_gaps: int
    failed_replays: int
    """Replays that did not end as the protocol says within ``replay_timeout`` (no answer, no end-of-replay, or
    over :data:`MAX_REPLAY_BATCHES` batches): what they had supplied by then is applied, live events go on."""
    restarts: int
    invalid_batches: int
    """Messages skipped: not three frames, an 8-byte sequence number and a decodable ``EventBatch``."""
    bad_sequences: int
    """Messages skipped for their sequence number: negative, or out of line and not continued by the next one."""
    write_errors: int
    """Index writes that raised (logged; the thread goes on)."""
    observer_errors: int
    """Rounds whose ``clock`` or ``lag_observer`` call raised (logged; the updates were applied, the thread goes on)."""
    reconnects: int
    handshake_failures: int
    """Connections to ``endpoint`` that did not become a ZMQ session with a publisher: something listens there that
    does not speak ZMQ (vLLM's HTTP port rather than its ``--kv-events-config`` endpoint, say), or a ZMQ socket of
    another kind (vLLM's replay endpoint). Logged sparsely from the second in a row (once is an engine that went away
    during a handshake); retried with the reconnect backoff."""
    last_lag_s: float | None
    blocks_held: int
    tracker: TrackerStats


class KVEventSubscriber:
    """A background thread that applies one backend's KV events to ``writer``, usually a
    :class:`~prefixroute.Router` (whose :meth:`~prefixroute.Router.write` takes its lock). A
    :class:`~prefixroute.vllm.Fleet` starts and stops these for you.

    ``endpoint`` is the engine's PUB address (``tcp://gpu0:5557``), ``replay_endpoint`` its ROUTER address (without
    it, lost messages cannot be recovered and are counted in ``stats().unrecovered_gaps``). ``topic`` filters by
    prefix as ZMQ does. ``namespace`` must be the router's (events must hash exactly as ``route()`` does).
    Decoding and re-hashing happen in this thread; each drained group of messages reaches ``writer`` in one
    :meth:`~prefixroute.vllm.IndexWriter.write` call.

    Sequence handling: a gap triggers a replay request; a sequence that goes backwards means the engine restarted,
    and the backend's blocks are dropped before the new stream applies; a subscriber that starts late replays from
    sequence 0 (as far back as the engine's replay buffer reaches), and the batches published while that replay
    ran, heard live after it with the same numbers and bytes, are skipped as duplicates. That catch-up runs once
    the publisher is there (its ZMQ handshake done: a subscriber may start before its engine), and again after each
    reconnect, from the batch after the last one applied. A sequence number that is
    negative, or repeats the last one (but 0, or one that continues a number held back), is skipped; one that goes
    backwards or jumps more than ``max_sequence_jump`` ahead, live or in a replay, is believed only when the next
    message continues from it (so a restart is acted on one batch late, and one corrupt number costs one batch, not
    the backend's blocks). :meth:`reset` forgets the sequence too.

    A replay is bounded as a whole: ``replay_timeout`` seconds from the request to the end-of-replay frame (not per
    frame), and at most :data:`MAX_REPLAY_BATCHES` batches kept; a replay that runs past either is counted in
    ``stats().failed_replays``, logged, and live events go on.

    An ``endpoint`` that does not answer as a ZMQ publisher (vLLM's HTTP port, or its replay endpoint: the two
    swapped) is not waited on in silence: each failed handshake is counted in ``stats().handshake_failures`` and,
    from the second in a row, logged; where libzmq gives up on the connection, a new socket retries it.

    ZMQ context: by default each :meth:`start` makes one of the subscriber's own (about 5 file descriptors and 2 libzmq
    threads of its own, besides the subscriber's thread and about 4 descriptors for its sockets and connection), which
    its thread terminates as it ends. Many subscribers in one process (a :class:`~prefixroute.vllm.Fleet` of
    data-parallel ranks) should share one: ``context=`` a ``zmq.Context`` (not a ``zmq.asyncio.Context``), which the
    subscriber only makes its sockets in, and never terminates (its owner does, after stopping the subscribers that
    use it; a termination while one still runs ends its thread). A :class:`~prefixroute.vllm.Fleet` does so.

    Nothing kills the thread: a malformed message, a bad sequence number, a failing write or a ``clock`` or
    ``lag_observer`` that raises is logged, counted in :meth:`stats` and skipped; a socket error reconnects with
    exponential backoff (``reconnect_backoff=(low, high)``, seconds: ``low`` doubled after each failure in a row, up
    to ``high``, and ``low`` again once a session has received a batch).

    Raises:
        ConfigurationError: an endpoint is not a ZMQ address, ``writer.block_size`` differs from the hasher's, an
            option is not a finite positive number (an int where a count), ``topic`` holds a lone surrogate,
            ``replay_endpoint`` is ``endpoint``, ``backend`` is an empty str, or ``context`` is terminated.
        TypeError: ``writer`` has no ``write`` method or no int ``block_size``, ``backend`` or ``topic`` is not a
            str, ``namespace`` not a str, bytes or None, ``lag_observer`` not a callable or None, ``clock`` not a
            callable, ``context`` not a ``zmq.Context`` or None (or a ``zmq.asyncio.Context``, whose sockets do not
            block).

    >>> with KVEventSubscriber(router, "gpu0", "tcp://127.0.0.1:5557") as sub:   # doctest: +SKIP
    ...     ...
    """

    def __init__(
        self,
        writer: IndexWriter,
        backend: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        namespace: str | bytes | None = None,
        replay_timeout: float = 1.0,
        max_batches_per_apply: int = 512,
        max_sequence_jump: int = 100_000,
        reconnect_backoff: tuple[float, float] = (0.1, 5.0),
        lag_observer: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.time,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        check_writer(writer)
        backend = check_backend(backend)
        check_endpoint(endpoint, "endpoint", "tcp://gpu0:5557")
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint, "replay_endpoint", "tcp://gpu0:5558")
            if replay_endpoint == endpoint:  # no engine binds both sockets on one address: one of them is a slip
                raise ConfigurationError(
                    f"replay_endpoint is endpoint ({endpoint!r}): vLLM publishes on one address and replays on "
                    "another (e.g. tcp://gpu0:5557 and tcp://gpu0:5558)"
                )
        if not isinstance(topic, str):
            raise InvalidTypeError(f"topic must be a str, not {type(topic).__name__}")
        try:
            topic.encode()  # as the thread subscribes: an error there would fail every session for good
        except UnicodeEncodeError:
            raise ConfigurationError(
                f"topic must be text that UTF-8 can encode, as vLLM's is, not {shown(topic)} (a lone surrogate)"
            ) from None
        replay_timeout = check_seconds(replay_timeout, "replay_timeout")
        max_batches_per_apply = check_count(max_batches_per_apply, "max_batches_per_apply")
        max_sequence_jump = check_count(max_sequence_jump, "max_sequence_jump")
        try:
            low, high = reconnect_backoff
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"reconnect_backoff must be a pair (low, high) of seconds, not {shown(reconnect_backoff)}"
            ) from None
        low = check_seconds(low, "reconnect_backoff's low")
        high = check_seconds(high, "reconnect_backoff's high")
        if low > high:
            raise ConfigurationError(f"reconnect_backoff must be (low, high) with low <= high, not {reconnect_backoff}")
        check_callable(lag_observer, "lag_observer", "taking a lag in seconds", optional=True)
        check_callable(clock, "clock", "returning seconds since the epoch")
        if context is not None:
            _check_context(context)
        self._tracker = BlockTracker(block_size=writer.block_size, namespace=namespace)  # validates the block size
        self.writer = writer
        self.backend = backend
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        # Guards the tracker: the thread holds it while handling messages, reset() and held() take it too. Reentrant:
        # writer, clock and lag_observer run in the thread under it, and may call held() or reset() themselves.
        self._state_lock = threading.RLock()
        self._writing = False  # inside writer.write() (under the state lock): a reset() now waits for it to return
        self._reset_due = False
        # A catch-up replay to run at the thread's next quiet moment: asked for by reset(), which forgot every block.
        self._catch_up_due = False
        self._decoder = EventDecoder()
        self._replay_timeout = replay_timeout
        self._max_batches = max_batches_per_apply
        self._max_jump = max_sequence_jump
        self._backoff = (low, high)
        self._lag_observer = lag_observer
        self._clock = clock
        self._context = context  # shared, never terminated here; None: each start() makes one, its thread ends it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_seq = -1  # last sequence number received and decoded (the thread writes it, and reset())
        self._applied_seq = -1  # last sequence number whose updates are in the index
        # The highest sequence number counted in "batches" in this stream: reset() forgets the sequence, not the
        # count, so the batches its replay applies again are not counted twice (a restart seen starts a new stream).
        self._counted_seq = -1
        self._pending: tuple[int, bytes] | None = None  # an out-of-line message, until the next one says
        # The batches the last catch-up replay applied, by sequence number: the digest of each payload. Those
        # published while it ran are also queued on the SUB socket, and arrive live after it, first.
        self._caught_up: dict[int, int] = {}
        self._counts = dict.fromkeys(
            (
                "batches", "events", "gaps", "replayed", "unrecovered", "failed_replays", "restarts", "invalid",
                "bad_sequences", "write_errors", "observer_errors", "reconnects", "handshake_failures",
            ),
            0,
        )  # fmt: skip
        self._last_lag: float | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> KVEventSubscriber:
        """Start the background thread (idempotent); return self.

        After a :meth:`stop` whose wait timed out, first waits (up to 5 s) for that thread to end.

        Raises:
            StateError: the thread of an earlier :meth:`stop` is still running after that wait, or the ``context``
                given has been terminated since.
            ConfigurationError: the process could not give the subscriber its ZMQ context or its thread (out of
                file descriptors or threads: a subscriber with a context of its own holds about 9 descriptors and 3
                threads, one sharing a ``context`` about 4 and 1); nothing is left running.
        """
        old = self._thread
        if old is not None and old.is_alive():
            if not self._stop.is_set():
                return self
            old.join(5.0)
            if old.is_alive():
                raise StateError(f"the KV-event thread of {self.backend} has not ended since stop(): try again")
        shared = self._context
        if shared is not None and shared.closed:
            raise StateError(
                f"the ZMQ context given to the KV-event subscriber of {self.backend} has been terminated: make the "
                "subscriber again with a live context (or none, to have one of its own)"
            )
        self._stop.clear()
        context = shared
        try:
            if context is None:
                context = zmq.Context()
            thread = threading.Thread(
                target=self._run,
                args=(context, shared is None),
                name=f"prefixroute-kv-events[{self.backend}]",
                daemon=True,
            )
            thread.start()
        except (zmq.ZMQError, OSError, RuntimeError) as exc:  # EMFILE, or "can't start new thread"
            if context is not None and shared is None:
                context.destroy(linger=0)
            if shared is not None:
                raise ConfigurationError(
                    f"the KV-event subscriber of {self.backend} could not start its thread ({exc}): the process is "
                    "out of threads; follow fewer endpoints in this process"
                ) from exc
            raise ConfigurationError(
                f"the KV-event subscriber of {self.backend} could not start ({exc}): each one with a ZMQ context of "
                "its own holds about 9 file descriptors and 3 threads; share one context (context=, as a Fleet "
                "does), raise the open-files limit (ulimit -n) or follow fewer endpoints in this process"
            ) from exc
        self._thread = thread  # only once started: a stop() from another thread cannot join it before (RuntimeError)
        return self

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stop the thread, waiting at most ``timeout`` seconds; the index keeps what was applied. Idempotent.

        The thread closes its own sockets as it ends. When it has not ended within ``timeout`` (a writer that
        blocks), this logs a warning and returns; :attr:`running` stays True until the thread really ends.

        Raises:
            ConfigurationError: ``timeout`` is not a finite number of seconds >= 0 (the thread is not stopped).
        """
        seconds = as_float(timeout)
        if seconds is None or not 0 <= seconds <= MAX_SECONDS:
            raise ConfigurationError(
                f"timeout must be a finite number of seconds >= 0 (at most {MAX_SECONDS:.0f}), not {shown(timeout)}"
            )
        timeout = seconds
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        if thread is not threading.current_thread():
            thread.join(timeout)
        if thread.is_alive():
            if thread is not threading.current_thread():
                _log.warning("KV events from %s: the thread has not ended within %gs of stop()", self.backend, timeout)
            return
        self._thread = None

    def _signal_stop(self) -> None:
        """Tell the thread to stop without waiting for it (within its 50 ms poll it does): the fleet signals a
        backend's subscribers together, then :meth:`stop` joins each, so stopping N takes one poll, not N."""
        self._stop.set()

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch whose updates are in the index (-1 before the first)."""
        return self._applied_seq

    def held(self) -> set[int]:
        """Return the own block hashes the events say the backend holds."""
        with self._state_lock:
            return self._tracker.held()

    def reset(self) -> None:
        """Drop the backend's blocks from the index and forget its sequence, e.g. when a health check sees the
        engine restart: the thread then replays the engine's buffer from sequence 0 (at its next quiet moment,
        about 50 ms, without waiting for a batch, which an idle engine may not publish for long) and follows on from
        the last batch replayed; a batch that arrives first is taken as a new stream's and what came before it is
        replayed. So a restart whose first batches were missed is recovered too. The batches replayed again are
        counted in ``stats().replayed_batches``, not twice in ``batches``. Without ``replay_endpoint`` nothing can be
        replayed: the backend's blocks come back as the engine publishes again.

        Called by ``writer`` from inside its own ``write()`` (in the subscriber's thread), it takes effect as that
        write returns: the updates being written are the tracker's, so they reach the index first and the reset
        then removes them with the rest (dropped at once, the write's stores would stay in the index, unknown to
        the tracker, for good).
        """
        with self._state_lock:
            if self._writing:  # only the subscriber's own thread can be here while it writes: it holds the lock
                self._reset_due = True
                return
            self._reset()

    def _reset(self) -> None:
        self._write(self._tracker.reset())
        self._last_seq = self._applied_seq = -1
        self._pending = None
        self._catch_up_due = self.replay_endpoint is not None

    def stats(self) -> SubscriberStats:
        """Return a snapshot of the counters. Each is exact, but they are read without waiting for the thread (a
        slow ``writer`` never holds up a metrics scrape), so one taken while a batch is applied may show it counted
        in ``batches`` before ``last_seq`` moves."""
        c = self._counts
        return SubscriberStats(
            backend=self.backend,
            last_seq=self._applied_seq,
            batches=c["batches"],
            events=c["events"],
            gaps=c["gaps"],
            replayed_batches=c["replayed"],
            unrecovered_gaps=c["unrecovered"],
            failed_replays=c["failed_replays"],
            restarts=c["restarts"],
            invalid_batches=c["invalid"],
            bad_sequences=c["bad_sequences"],
            write_errors=c["write_errors"],
            observer_errors=c["observer_errors"],
            reconnects=c["reconnects"],
            handshake_failures=c["handshake_failures"],
            last_lag_s=self._last_lag,
            blocks_held=len(self._tracker),
            tracker=replace(self._tracker.stats),
        )

    # -- the thread ------------------------------------------------------------------------------------------------

    def _run(self, context: zmq.Context[Any], owned: bool) -> None:
        try:
            delay = self._backoff[0]
            while not self._stop.is_set():
                received = self._messages()
                try:
                    self._session(context)  # returns only once stopped
                except Exception as exc:  # noqa: BLE001 - the thread must outlive any one bad moment
                    if self._stop.is_set():
                        return
                    if isinstance(exc, zmq.ContextTerminated) or context.closed:  # by its owner: for good
                        _log.warning("KV events from %s: the ZMQ context was terminated; the subscriber stops",
                                     self.endpoint)  # fmt: skip
                        return
                    if self._messages() != received:  # that session worked: its failure starts a new series
                        delay = self._backoff[0]
                    self._counts["reconnects"] += 1
                    if isinstance(exc, (zmq.ZMQError, _Abandoned)):
                        _log.warning("KV events from %s: %s; reconnecting in %.1fs", self.endpoint, exc, delay)
                    else:
                        _log.exception(
                            "KV events from %s: unexpected error; reconnecting in %.1fs", self.endpoint, delay
                        )
                    self._stop.wait(delay)
                    delay = min(delay * 2, self._backoff[1])
        finally:
            if owned:  # a shared context is its owner's to terminate, once every subscriber using it has stopped
                context.destroy(linger=0)  # by the thread that used its sockets, which ZMQ requires

    def _session(self, context: zmq.Context[Any]) -> None:
        sub = context.socket(zmq.SUB)
        monitor: zmq.Socket[bytes] | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # libzmq reconnects a dropped TCP connection by itself, backing off up to RECONNECT_IVL_MAX (both are
            # C ints of milliseconds: a longer backoff is clamped, not an error in the thread).
            sub.setsockopt(zmq.RECONNECT_IVL, _socket_ms(self._backoff[0]))
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, _socket_ms(self._backoff[1]))
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            # A peer that is no publisher fails the handshake (libzmq retries it), or drops the connection before it
            # is done (a ZMQ socket of another kind: libzmq never reconnects), and libzmq says nothing of either: the
            # socket's monitor is how they are noticed, and a new session is how the second is retried.
            monitor = sub.get_monitor_socket(_WATCHED)
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            sub.connect(self.endpoint)
            link = _Link()
            while not self._stop.is_set():
                ready = dict(poller.poll(_STOP_POLL_MS))
                if monitor in ready and self._watch(monitor, link) and self.replay_endpoint is not None:
                    # A session with the publisher began, the first or one after a drop: the batches published
                    # before its subscription took effect (ZMQ's slow joiner), or while it was down, would only be
                    # noticed at the next batch, which an idle engine may not send for long. They are fetched from
                    # the replay at the next quiet poll: once the publisher is there, not at connect() (a subscriber
                    # started before its engine would find nothing to ask, and miss the engine's first batches).
                    self._catch_up_due = True
                if link.dropped_at is not None and time.monotonic() - link.dropped_at > _ABANDONED_S:
                    raise _Abandoned(
                        "the connection was dropped and libzmq will not reconnect (a peer that broke ZMQ's protocol, "
                        f"sent a frame over {MAX_MESSAGE_BYTES} bytes, or is a ZMQ socket that is no publisher, "
                        "such as vLLM's replay endpoint)"
                    )
                if sub not in ready:
                    # Due after a session began or a reset(); with no session (the engine not there yet, or gone
                    # and reconnecting) it waits for the next: the handshake asks for it anyway.
                    if not ready and self._catch_up_due and link.up:
                        with self._state_lock:
                            if self._catch_up_due:  # not taken by a batch meanwhile (reset() runs under the lock)
                                self._catch_up(context)
                    continue
                messages = [sub.recv_multipart(copy=True)]
                while len(messages) < self._max_batches:
                    try:
                        messages.append(sub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                with self._state_lock:
                    self._handle(messages, context)
        finally:
            _close(sub, monitor)

    def _watch(self, monitor: zmq.Socket[bytes], link: _Link) -> bool:
        """Follow the SUB socket's monitor in ``link``; count and log the handshakes that fail. Return whether a
        session with the publisher began (a handshake succeeded)."""
        began = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return began
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_RETRIED):
                link.handshaking, link.dropped_at = event == zmq.EVENT_CONNECTED, None
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.handshaking, link.failed_in_a_row = False, 0
                link.up = began = True
            elif event & _HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and link.handshaking):
                link.handshaking = False
                link.failed_in_a_row += 1
                self._counts["handshake_failures"] += 1
                # Once is an engine that went away during a handshake (a restart); again and again, no publisher.
                level = sparse_level(link.failed_in_a_row) if link.failed_in_a_row > 1 else logging.DEBUG
                _log.log(level, "KV events from %s: %s does not answer as a ZMQ publisher (failed handshakes in a "
                         "row: %d): is it vLLM's --kv-events-config endpoint?", self.backend, self.endpoint,
                         link.failed_in_a_row)  # fmt: skip
            if event == zmq.EVENT_DISCONNECTED:
                link.dropped_at = time.monotonic()
                link.up = False

    def _handle(self, messages: list[list[bytes]], context: zmq.Context[Any]) -> None:
        ops: IndexOps = []
        timestamps: list[float] = []
        try:
            for frames in messages:
                try:
                    self._handle_message(frames, ops, timestamps, context)
                except zmq.ContextTerminated:
                    raise  # a replay that could not begin: the thread ends, no message is at fault
                except Exception:  # noqa: BLE001 - one bad message must not cost the others
                    self._counts["invalid"] += 1
                    _log.exception("KV events from %s: skipping a message that could not be handled", self.backend)
        finally:
            self._finish(ops, timestamps)  # what the tracker took in reaches the index, even as the thread ends

    def _finish(self, ops: IndexOps, timestamps: list[float]) -> None:
        """Write what a round of messages produced, then note how far the index is and how late it is."""
        self._write(ops)
        self._applied_seq = self._last_seq
        if not timestamps:
            return
        try:
            now = self._clock()
            lag = now - timestamps[-1]
            if not isinstance(lag, float):
                raise InvalidTypeError(f"clock() returned {type(now).__name__}, not seconds since the epoch")
            self._last_lag = lag
            if self._lag_observer is not None:
                for ts in timestamps:
                    self._lag_observer(now - ts)
        except Exception:  # noqa: BLE001 - a faulty callback must not cost the stream (a reconnect loses batches)
            errors = self._counts["observer_errors"] = self._counts["observer_errors"] + 1
            _log.log(sparse_level(errors), "KV events from %s: clock or lag_observer raised (%d times so far); the "
                     "updates were applied", self.backend, errors, exc_info=True)  # fmt: skip

    def _write(self, ops: IndexOps) -> None:
        if not ops:
            return
        self._writing = True
        try:
            self.writer.write(self.backend, ops)
        except Exception:  # noqa: BLE001 - the thread outlives a failing writer; the failure is counted
            self._counts["write_errors"] += 1
            _log.exception("KV events from %s: writing %d index updates failed", self.backend, len(ops))
        finally:
            self._writing = False
        if self._reset_due:  # writer called reset() in that write: done now, after the updates it was writing
            self._reset_due = False
            self._reset()

    def _handle_message(
        self, frames: list[bytes], ops: IndexOps, timestamps: list[float], context: zmq.Context[Any]
    ) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._counts["invalid"] += 1
            _log.log(
                sparse_level(self._counts["invalid"]),
                "KV events from %s: a message of %d frames, expected 3 (topic, 8-byte sequence, payload)",
                self.backend,
                len(frames),
            )
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            self._bad_sequence(seq, "negative")
            return
        if self._caught_up:
            digest = self._caught_up.get(seq)
            if digest is not None and seq <= self._last_seq and digest == xxhash.xxh3_64_intdigest(frames[2]):
                return  # applied by the catch-up replay already (a restarted engine's batch has other bytes)
            self._caught_up.clear()  # past the replayed ones: no more can come
        pending = self._pending
        continues = pending is not None and seq == pending[0] + 1
        # A repeat of the last number, unless it continues a held-back one: a restarted engine's 1 after its 0,
        # where the old stream had ended at 1, is the new stream's (else the restart would never be seen).
        if seq == self._last_seq and seq > 0 and not continues:
            self._bad_sequence(seq, "a repeat of the last batch")
            return
        self._pending = None
        if pending is not None:
            if continues:  # the stream really moved there: an engine restart, or a long loss
                self._accept(*pending, ops, timestamps, context)
            else:
                self._bad_sequence(pending[0], f"out of line after {self._last_seq}, and {seq} did not follow it")
        last = self._last_seq
        if last < seq <= last + 1 + self._max_jump:
            self._accept(seq, frames[2], ops, timestamps, context)
        else:
            self._pending = (seq, frames[2])

    def _bad_sequence(self, seq: int, why: str) -> None:
        self._counts["bad_sequences"] += 1
        _log.log(sparse_level(self._counts["bad_sequences"]), "KV events from %s: skipping the batch numbered %d: %s",
                 self.backend, seq, why)  # fmt: skip

    def _accept(
        self, seq: int, payload: bytes, ops: IndexOps, timestamps: list[float], context: zmq.Context[Any]
    ) -> None:
        self._catch_up_due = False  # what came before this batch is replayed here, as a gap
        last = self._last_seq
        if last >= 0 and seq <= last:
            self._counts["restarts"] += 1
            _log.warning("KV events from %s: sequence went back %d -> %d: engine restart", self.backend, last, seq)
            ops.extend(self._tracker.reset())
            last = self._last_seq = self._counted_seq = -1
        if seq > last + 1:
            if last >= 0:
                self._counts["gaps"] += 1
            self._recover(last + 1, seq - 1, ops, timestamps, context)
        self._apply_payload(seq, payload, ops, timestamps)

    def _messages(self) -> int:
        """Messages received so far, live or replayed, valid or not: a session that received one had a working
        socket."""
        return self._counts["batches"] + self._counts["invalid"]

    def _apply_payload(self, seq: int, payload: bytes, ops: IndexOps, timestamps: list[float]) -> None:
        self._last_seq = seq
        try:
            batch = self._decoder.decode(payload)
        except InvalidEventError as exc:
            invalid = self._counts["invalid"] = self._counts["invalid"] + 1
            _log.log(sparse_level(invalid), "KV events from %s: skipping batch %d (%d invalid so far): %s",
                     self.backend, seq, invalid, exc)  # fmt: skip
            return
        if seq > self._counted_seq:  # not one that a replay after reset() applies again
            self._counted_seq = seq
            self._counts["batches"] += 1
            self._counts["events"] += len(batch.events)
        ops.extend(self._tracker.apply(batch.events))
        if math.isfinite(batch.ts):
            timestamps.append(batch.ts)

    def _catch_up(self, context: zmq.Context[Any]) -> None:
        """Apply every batch the engine's replay buffer holds after the last one seen."""
        self._catch_up_due = False
        ops: IndexOps = []
        timestamps: list[float] = []
        replayed = self._replay(context, self._last_seq + 1, _LATEST)
        self._caught_up = {}
        for position, (seq, payload) in enumerate(replayed):
            if self._last_seq >= 0 and seq > self._last_seq + 1 + self._max_jump:  # believed as live ones are:
                following = replayed[position + 1][0] if position + 1 < len(replayed) else None
                if following != seq + 1:  # only when the next batch continues from it
                    self._bad_sequence(seq, f"{seq - self._last_seq} ahead of {self._last_seq} in the replay")
                    continue
            if seq > self._last_seq:
                if seq > self._last_seq + 1:  # the buffer no longer holds what came before: those updates are lost
                    self._counts["unrecovered"] += 1
                    _log.warning("KV events from %s: batches %d..%d are no longer in the replay buffer; the index "
                                 "may miss updates", self.backend, self._last_seq + 1, seq - 1)  # fmt: skip
                self._apply_payload(seq, payload, ops, timestamps)
                self._counts["replayed"] += 1
                self._caught_up[seq] = xxhash.xxh3_64_intdigest(payload)
        self._finish(ops, timestamps)

    def _recover(self, start: int, end: int, ops: IndexOps, timestamps: list[float], context: zmq.Context[Any]) -> None:
        """Replay batches ``start..end`` (inclusive); count an unrecovered gap when some cannot be had.

        Batches the engine's replay buffer no longer holds are lost; the ones after them are still applied (their
        blocks whose parent was lost are skipped by the tracker, so no false prefix is stored; a lost removal,
        though, leaves its blocks in the index until a clear, a restart or :meth:`reset`).
        """
        replies = self._replay(context, start, end) if self.replay_endpoint is not None else []
        expected = start
        lost = False
        for seq, payload in replies:
            if seq < expected or seq > end:
                continue
            lost = lost or seq > expected
            self._apply_payload(seq, payload, ops, timestamps)
            self._counts["replayed"] += 1
            expected = seq + 1
        if lost or expected <= end:
            self._counts["unrecovered"] += 1
            if self.replay_endpoint is None:
                why = "not configured"
            elif self._stop.is_set():  # a deliberate stop, not a fault: said, not warned about
                why = "cut short by stop()"
            else:
                why = "could not supply them all"
            (_log.info if self._stop.is_set() else _log.warning)(
                "KV events from %s: some of batches %d..%d are lost (replay %s); the index may miss updates",
                self.backend,
                start,
                end,
                why,
            )

    def _replay(self, context: zmq.Context[Any], start: int, end: int) -> list[tuple[int, bytes]]:
        """Ask for batches ``start..end`` and return the ones received, in increasing sequence order.

        The whole exchange is bounded: ``replay_timeout`` seconds in all (a deadline, not a wait per frame) and at
        most :data:`MAX_REPLAY_BATCHES` batches. A replay cut short by either (or that never ends) is counted in
        ``failed_replays`` and what it supplied is returned. Duplicates and batches out of order are dropped.
        """
        assert self.replay_endpoint is not None
        replies: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self._replay_timeout
        failure: str | None = None
        # A fresh DEALER per request: a late reply to an abandoned request can never be mistaken for this one's.
        dealer = context.socket(zmq.DEALER)
        monitor: zmq.Socket[bytes] | None = None
        try:
            # Its monitor says, when no end of replay comes, whether a ZMQ replay socket ever answered.
            monitor = dealer.get_monitor_socket(_WATCHED)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    failure = f"no end of replay within {self._replay_timeout:g}s{self._replay_link(monitor)}"
                    break
                if self._stop.is_set():
                    break
                if not dealer.poll(max(1, min(_STOP_POLL_MS, math.ceil(left * 1000)))):
                    continue
                frames = dealer.recv_multipart()
                # [b"", seq, payload]; vLLM >= 0.26 adds the topic, as on the PUB socket: [b"", topic, seq, payload]
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_OF_REPLAY:
                    break
                if seq < start or (replies and seq <= replies[-1][0]):
                    continue  # before what was asked for, or a duplicate or out of order: nothing to apply
                if seq > end:
                    break
                replies.append((seq, frames[-1]))
                if seq == end:
                    break
                if len(replies) >= MAX_REPLAY_BATCHES:
                    failure = f"over {MAX_REPLAY_BATCHES} batches"
                    break
        finally:
            _close(dealer, monitor)
        if failure is not None:
            self._counts["failed_replays"] += 1
            _log.warning(
                "KV events from %s: the replay of batches from %d from %s failed (%s); %d batches kept, live events "
                "go on",
                self.backend, start, self.replay_endpoint, failure, len(replies),
            )  # fmt: skip
        return replies

    def _replay_link(self, monitor: zmq.Socket[bytes]) -> str:
        """What the replay socket's monitor tells of a replay that got no end, as the end of its failure's words:
        nothing for a ZMQ session that stayed up (an engine that did not answer in time)."""
        connected = handshaking = failed = session = dropped = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                break
            connected = connected or event == zmq.EVENT_CONNECTED
            session = session or event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            failed = failed or bool(event & _HANDSHAKE_FAILED) or (event == zmq.EVENT_DISCONNECTED and handshaking)
            dropped = dropped or (event == zmq.EVENT_DISCONNECTED and session)
            handshaking = event == zmq.EVENT_CONNECTED
        if dropped:
            return ": the connection was dropped, by a frame over MAX_MESSAGE_BYTES or an engine gone"
        if failed and not session:
            return f": {self.replay_endpoint} does not answer as a ZMQ replay socket: is it vLLM's replay_endpoint?"
        return "" if connected else ": no connection could be made to it"


def _check_context(context: object) -> None:
    """Refuse a ``context=`` the thread could not use: not a blocking ``zmq.Context``, or one terminated already."""
    import zmq.asyncio  # here: the asyncio machinery only when a context is given

    if not isinstance(context, zmq.Context) or isinstance(context, zmq.asyncio.Context):
        raise InvalidTypeError(
            f"context must be a zmq.Context (not a zmq.asyncio.Context: the thread blocks on its sockets) or None, "
            f"not {type(context).__name__}"
        )
    if context.closed:
        raise ConfigurationError("context is a terminated zmq.Context: pass a live one, or None for one of its own")


def _close(socket: zmq.Socket[Any], monitor: zmq.Socket[bytes] | None) -> None:
    """Close ``socket`` and its monitor with linger 0, as a context's termination needs them closed."""
    if monitor is not None:
        # Refused (ETERM) once the context's termination began: closing the socket then stops its monitor itself.
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        monitor.close(linger=0)
    socket.close(linger=0)


def _socket_ms(seconds: float) -> int:
    """``seconds`` as a ZMQ socket option in milliseconds (a C int): at least 1, at most 2**31 - 1."""
    return max(1, min(2**31 - 1, round(seconds * 1000)))
