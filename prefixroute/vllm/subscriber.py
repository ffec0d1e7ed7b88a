"""Subscribe to one vLLM engine's KV-cache events and keep a :class:`~prefixroute.PrefixIndex` exact.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv@gpu0@llama"}'``) publishes on a ZMQ PUB socket messages of three
frames: topic, an 8-byte big-endian sequence number and a msgpack ``EventBatch``. A ROUTER socket replays buffered
messages: a DEALER sends ``[b"", start_seq]`` and receives ``[b"", seq, payload]`` frames until ``seq == -1``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import zmq

from prefixroute.errors import ConfigurationError, InvalidEventError
from prefixroute.vllm.events import EventDecoder
from prefixroute.vllm.tracker import BlockTracker, IndexOps, IndexWriter, TrackerStats, apply_ops

__all__ = ["KVEventSubscriber", "SubscriberStats"]

_log = logging.getLogger(__name__)
_END_OF_REPLAY = -1


@dataclass(frozen=True)
class SubscriberStats:
    """A snapshot of a subscriber's counters (see :meth:`KVEventSubscriber.stats`)."""

    backend: str
    last_seq: int
    batches: int
    events: int
    gaps: int
    replayed_batches: int
    unrecovered_gaps: int
    restarts: int
    invalid_batches: int
    reconnects: int
    last_lag_s: float | None
    blocks_held: int
    tracker: TrackerStats


class KVEventSubscriber:
    """A background thread that applies one backend's KV events to ``index``.

    Of ``index`` only ``block_size``, ``insert`` and ``remove`` are used (see
    :class:`~prefixroute.vllm.tracker.IndexWriter`).

    ``endpoint`` is the engine's PUB address (``tcp://gpu0:5557``), ``replay_endpoint`` its ROUTER address (without
    it, lost messages cannot be recovered and are counted in ``stats().unrecovered_gaps``). ``topic`` filters by
    prefix as ZMQ does. ``namespace`` and ``block_size`` must be the router's. Index updates are applied under
    ``lock`` (share the lock that guards every other reader and writer of ``index``; None: a private lock, enough
    only when nothing else touches the index concurrently). Decoding and re-hashing happen outside the lock, so a
    concurrent ``route()`` waits at most for a handful of dict updates.

    Sequence handling: a gap triggers a replay request; a sequence that goes backwards means the engine restarted,
    and the backend's blocks are dropped before the new stream applies; a subscriber that starts late replays from
    sequence 0 (as far back as the engine's replay buffer reaches).

    >>> from prefixroute import PrefixIndex
    >>> with KVEventSubscriber(PrefixIndex(), "gpu0", "tcp://127.0.0.1:5557") as sub:   # doctest: +SKIP
    ...     ...
    """

    def __init__(
        self,
        index: IndexWriter,
        backend: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        namespace: str | bytes | None = None,
        block_size: int = 16,
        lock: threading.Lock | threading.RLock | None = None,
        replay_timeout: float = 1.0,
        max_batches_per_apply: int = 512,
        reconnect_backoff: tuple[float, float] = (0.1, 5.0),
        lag_observer: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ConfigurationError(f"endpoint must be a ZMQ address like 'tcp://host:5557', not {endpoint!r}")
        if replay_endpoint is not None and "://" not in replay_endpoint:
            raise ConfigurationError(
                f"replay_endpoint must be a ZMQ address like 'tcp://host:5558' or None, not {replay_endpoint!r}"
            )
        if index.block_size != block_size:
            raise ConfigurationError(
                f"block_size={block_size} differs from the index's block size {index.block_size}: pass the same"
            )
        low, high = reconnect_backoff
        if not 0 < low <= high:
            raise ConfigurationError(
                f"reconnect_backoff must be (low, high) with 0 < low <= high, not {reconnect_backoff}"
            )
        self.index = index
        self.backend = backend
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._lock: Any = lock if lock is not None else threading.Lock()
        # Guards the tracker: the thread holds it while handling messages, reset() and held() take it too.
        self._state_lock = threading.Lock()
        self._tracker = BlockTracker(block_size=block_size, namespace=namespace)
        self._decoder = EventDecoder()
        self._replay_timeout_ms = max(1, int(replay_timeout * 1000))
        self._max_batches = max(1, max_batches_per_apply)
        self._backoff = (low, high)
        self._lag_observer = lag_observer
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context[Any] | None = None
        self._last_seq = -1  # last sequence number received and decoded (only the thread writes it)
        self._applied_seq = -1  # last sequence number whose updates are in the index
        self._counts = dict.fromkeys(
            ("batches", "events", "gaps", "replayed", "unrecovered", "restarts", "invalid", "reconnects"), 0
        )
        self._last_lag: float | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> KVEventSubscriber:
        """Start the background thread (idempotent); return self."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._context = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"prefixroute-kv-events[{self.backend}]", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the sockets; the index keeps what was applied. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

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
        """Return the own block hashes the events say the backend holds (read under the lock)."""
        with self._state_lock:
            return self._tracker.held()

    def reset(self) -> None:
        """Drop the backend's blocks from the index, e.g. when a health check sees the engine restart."""
        with self._state_lock:
            ops = self._tracker.reset()
            with self._lock:
                apply_ops(self.index, self.backend, ops)

    def stats(self) -> SubscriberStats:
        """Return a snapshot of the counters."""
        c = self._counts
        return SubscriberStats(
            backend=self.backend,
            last_seq=self._applied_seq,
            batches=c["batches"],
            events=c["events"],
            gaps=c["gaps"],
            replayed_batches=c["replayed"],
            unrecovered_gaps=c["unrecovered"],
            restarts=c["restarts"],
            invalid_batches=c["invalid"],
            reconnects=c["reconnects"],
            last_lag_s=self._last_lag,
            blocks_held=len(self._tracker),
            tracker=replace(self._tracker.stats),
        )

    # -- the thread ------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            try:
                self._session()
                delay = self._backoff[0]
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any one bad moment
                if self._stop.is_set():
                    return
                self._counts["reconnects"] += 1
                if isinstance(exc, zmq.ZMQError):
                    _log.warning("KV events from %s: %s; reconnecting in %.1fs", self.endpoint, exc, delay)
                else:
                    _log.exception("KV events from %s: unexpected error; reconnecting in %.1fs", self.endpoint, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, self._backoff[1])

    def _session(self) -> None:
        assert self._context is not None
        sub = self._context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            # libzmq reconnects a dropped TCP connection by itself, backing off up to RECONNECT_IVL_MAX.
            sub.setsockopt(zmq.RECONNECT_IVL, int(self._backoff[0] * 1000))
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._backoff[1] * 1000))
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sub.connect(self.endpoint)
            while not self._stop.is_set():
                if not sub.poll(50):
                    continue
                messages = [sub.recv_multipart(copy=True)]
                while len(messages) < self._max_batches:
                    try:
                        messages.append(sub.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                with self._state_lock:
                    self._handle(messages)
        finally:
            sub.close(linger=0)

    def _handle(self, messages: list[list[bytes]]) -> None:
        ops: IndexOps = []
        timestamps: list[float] = []
        for frames in messages:
            if len(frames) != 3 or len(frames[1]) != 8:
                self._counts["invalid"] += 1
                _log.warning("KV events from %s: a message of %d frames, expected 3", self.backend, len(frames))
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            last = self._last_seq
            if last >= 0 and seq <= last:
                self._counts["restarts"] += 1
                _log.warning("KV events from %s: sequence went back %d -> %d: engine restart", self.backend, last, seq)
                ops.extend(self._tracker.reset())
                last = self._last_seq = -1
            if seq > last + 1:
                if last >= 0:
                    self._counts["gaps"] += 1
                self._recover(last + 1, seq - 1, ops, timestamps)
            self._apply_payload(seq, frames[2], ops, timestamps)
        with self._lock:
            apply_ops(self.index, self.backend, ops)
        self._applied_seq = self._last_seq
        if timestamps:
            now = self._clock()
            self._last_lag = now - timestamps[-1]
            if self._lag_observer is not None:
                for ts in timestamps:
                    self._lag_observer(now - ts)

    def _apply_payload(self, seq: int, payload: bytes, ops: IndexOps, timestamps: list[float]) -> None:
        self._last_seq = seq
        try:
            batch = self._decoder.decode(payload)
        except InvalidEventError as exc:
            self._counts["invalid"] += 1
            _log.warning("KV events from %s: skipping batch %d: %s", self.backend, seq, exc)
            return
        self._counts["batches"] += 1
        self._counts["events"] += len(batch.events)
        ops.extend(self._tracker.apply(batch.events))
        timestamps.append(batch.ts)

    def _recover(self, start: int, end: int, ops: IndexOps, timestamps: list[float]) -> None:
        """Replay batches ``start..end`` (inclusive); count an unrecovered gap when some cannot be had.

        Batches the engine's replay buffer no longer holds are lost; the ones after them are still applied (their
        blocks whose parent was lost are skipped by the tracker, so the index never holds a false block).
        """
        replies = self._replay(start, end) if self.replay_endpoint is not None else []
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
            _log.warning(
                "KV events from %s: some of batches %d..%d are lost (replay %s); the index may miss updates",
                self.backend,
                start,
                end,
                "not configured" if self.replay_endpoint is None else "could not supply them all",
            )

    def _replay(self, start: int, end: int) -> list[tuple[int, bytes]]:
        assert self._context is not None and self.replay_endpoint is not None
        replies: list[tuple[int, bytes]] = []
        # A fresh DEALER per request: a late reply to an abandoned request can never be mistaken for this one's.
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(self._replay_timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END_OF_REPLAY:
                    break
                if seq >= start:
                    replies.append((seq, frames[2]))
                if seq >= end:
                    break
        finally:
            dealer.close(linger=0)
        return replies
