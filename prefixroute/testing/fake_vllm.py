"""A fake vLLM engine on loopback that speaks vLLM's real protocols: KV events over ZMQ, ``/metrics``, completions.

For tests and demos of :mod:`prefixroute.vllm` without a GPU::

    with FakeVLLM(num_blocks=512) as engine, Fleet(Router(index=EventIndex(16))) as fleet:
        fleet.add_backend("gpu0", kv_events=engine.endpoint, replay=engine.replay_endpoint, metrics_url=engine.url)
        engine.complete(list(range(64)))      # publishes a BlockStored batch
        engine.url                            # http://127.0.0.1:PORT (/metrics, /v1/completions, /v1/models)

Faults, for tests of what a client does with a misbehaving engine: :meth:`FakeVLLM.set_metrics_fault` (any
``/metrics`` text, a delay, a body trickled byte by byte) and :meth:`FakeVLLM.publish_raw` (any ZMQ frames: garbage,
truncated payloads, odd sequence numbers).
"""

from __future__ import annotations

import io
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType, TracebackType
from typing import Any, Literal
from urllib.parse import unquote

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from prefixroute._numbers import as_float, as_int, check_flag, shown
from prefixroute.adapters._slashes import slash_redirect
from prefixroute.errors import ConfigurationError, InvalidTypeError, StateError
from prefixroute.testing._http import (
    JSON,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    PREFLIGHT_BODY,
    cors_headers,
    is_preflight,
    json_body,
    preflight_headers,
)
from prefixroute.testing._names import check_served_names, model_list
from prefixroute.testing._requests import (
    Invalid,
    check_types,
    error_body,
    json_object,
    model_not_found,
    read_max_tokens,
)
from prefixroute.testing.fake_cache import CachedChain, FakeBlockCache, FakeRequest
from prefixroute.vllm._checks import MAX_SECONDS
from prefixroute.vllm.events import EventBatch, encode_batch
from prefixroute.vllm.metrics import TTFT_BUCKETS

__all__ = ["Completion", "FakeVLLM"]

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_ROUTES = MappingProxyType({"/v1/models": "GET", "/health": "GET", "/v1/completions": "POST"})  # each one's method
_MAX_LINE = 65_536  # the longest chunk-size or trailer line read


@dataclass(frozen=True)
class Completion:
    """What the fake did with one prompt."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def _frame(frame: object, name: str) -> bytes:
    """``frame`` as the bytes of a ZMQ frame (a bytearray or memoryview copied), checked before the publisher thread
    sees it: a frame ZMQ cannot send would end that thread, and every batch after it would be lost."""
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, (bytearray, memoryview)):
        return bytes(frame)
    raise InvalidTypeError(f"{name} must be bytes, not {type(frame).__name__}")


def default_ttft(cached_tokens: int, prompt_tokens: int, waiting: int) -> float:
    """A 13B-on-A100-like TTFT: 15 ms, plus 0.12 ms per uncached prompt token, plus 60 ms per waiting request."""
    return 0.015 + 0.00012 * (prompt_tokens - cached_tokens) + 0.06 * waiting


def _check_options(
    *,
    flags: Mapping[str, object],
    model: object,
    topic: object,
    encoding: object,
    replay_buffer: object,
    ttft: object,
    clock: object,
    seed: object,
    host: object,
    ports: tuple[object, object],
) -> tuple[int, int, int, int]:
    """Raise for a :class:`FakeVLLM` option it could not use (when given, not in its I/O thread); return its int
    options (``replay_buffer``, ``seed``, the two ports) as Python ints."""
    check_served_names(model, ())
    for name, flag in flags.items():
        check_flag(flag, name)
    for name, text in (("topic", topic), ("host", host)):
        if not isinstance(text, str):
            raise ConfigurationError(f"{name} must be a str, not {shown(text)}")
        try:  # as each publish and the bind do: an error there would fail every request or the start
            text.encode()
        except UnicodeEncodeError:
            raise ConfigurationError(f"{name} must be text that UTF-8 can encode, not {shown(text)}") from None
    if not isinstance(encoding, str) or encoding not in ("array", "map", "alternate"):
        raise ConfigurationError(f"encoding must be 'array', 'map' or 'alternate', not {shown(encoding)}")
    buffer = as_int(replay_buffer)
    if buffer is None or not 0 <= buffer <= 2**31:
        raise ConfigurationError(f"replay_buffer must be an int in [0, 2**31], not {shown(replay_buffer)}")
    if not callable(ttft):
        raise InvalidTypeError(
            f"ttft must be a callable (cached, prompt, waiting) -> seconds, not {type(ttft).__name__}"
        )
    if not callable(clock):
        raise InvalidTypeError(f"clock must be a callable returning seconds since the epoch, not {shown(clock)}")
    seed_int = as_int(seed)
    if seed_int is None:
        raise ConfigurationError(f"seed must be an int, not {shown(seed)}")
    numbers = []
    for port in ports:
        number = as_int(port)
        if number is None or not 0 <= number <= 65535:
            raise ConfigurationError(
                f"port and replay_port must be ints in [0, 65535] (0: any free), not {shown(port)}"
            )
        numbers.append(number)
    return buffer, seed_int, numbers[0], numbers[1]


class FakeVLLM:
    """A fake engine: KV events on a ZMQ PUB socket and a replay ROUTER, HTTP ``/metrics``, ``/v1/completions`` and
    ``/v1/models`` (and vLLM's ``/health``). ``/v1/completions`` serves ``model``, and a request that names none
    (absent, null or ``""``); one naming another model gets vLLM's 404 (``NotFoundError``, ``param`` "model"). A
    route's path with trailing slashes (``/v1/completions/``) is Starlette's empty 307 to the route, as vLLM's app
    answers it.

    Every cache-changing call publishes one ``EventBatch`` (as a vLLM scheduler step does) with the next sequence
    number, in ``encoding`` (``"array"``, ``"map"`` or ``"alternate"``, which switches per batch), stamped with
    ``clock()`` (seconds since the epoch; :func:`time.time` by default, a test's own clock sets the lag a subscriber
    measures; a clock that raises or returns no number makes the call raise, and the next batch carries its
    events). The replay socket answers as vLLM >= 0.26 does, each reply ``[topic, seq, payload]`` as on the PUB
    socket and the end of the replay ``[b"", -1, b""]`` (an empty topic); ``replay_topic=False`` answers as older
    vLLM, ``[seq, payload]`` and ``[-1, b""]``. Test hooks:
    :meth:`drop_next` loses published messages (still in the replay buffer), :meth:`restart` simulates a process
    restart (sequence back to 0, new hash seed, empty cache), :meth:`chains`/:meth:`own_hashes` give the true cache
    contents. ``port`` and ``replay_port`` are picked by the OS on ``host`` unless given (a new engine on an old
    engine's ports is how a test restarts the process for real). Thread-safe.

    Raises:
        ConfigurationError: a count, port, ``seed``, ``encoding`` or ``hash_format`` the fake cannot use, a flag
            (``extra_group``, ``replay``, ``replay_topic``, ``legacy_metric_names``) that is not a bool, a ``model``,
            ``topic`` or ``host`` that is not a str or holds a lone surrogate, or a ``model`` name that is blank, not
            printable or holds a lone surrogate: whatever its type, an option's value it cannot use (checked when
            given).
        TypeError: ``ttft`` or ``clock`` is not a callable.
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        model: str = "fake-model",
        topic: str = "",
        encoding: Literal["array", "map", "alternate"] = "array",
        hash_format: Literal["int", "bytes"] = "int",
        extra_group: bool = False,
        replay_buffer: int = 10_000,
        replay: bool = True,
        replay_topic: bool = True,
        legacy_metric_names: bool = False,
        ttft: Callable[[int, int, int], float] = default_ttft,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int = 0,
    ) -> None:
        flags = {"extra_group": extra_group, "replay": replay, "replay_topic": replay_topic,
                 "legacy_metric_names": legacy_metric_names}  # fmt: skip
        replay_buffer, seed, port, replay_port = _check_options(
            flags=flags, model=model, topic=topic, encoding=encoding, replay_buffer=replay_buffer, ttft=ttft,
            clock=clock, seed=seed, host=host, ports=(port, replay_port),
        )  # fmt: skip
        self._rng = random.Random(seed)
        self._ids = random.Random(seed)  # /v1/models' permission ids and answers' ids (the cache draws from _rng)
        self.cache = FakeBlockCache(
            block_size=block_size, num_blocks=num_blocks, rng=self._rng, hash_format=hash_format,
            extra_group=extra_group,
        )  # fmt: skip
        self.model = model
        self.topic = topic
        self.encoding = encoding
        self.legacy_metric_names = legacy_metric_names
        self._ttft = ttft
        self._clock = clock
        self._host = host
        self._ports = (port, replay_port)
        self._replay_enabled = replay
        self._replay_topic = replay_topic
        self._lock = threading.RLock()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_buffer)
        # Messages for the ZMQ thread to send; what is published while stopped goes out once started again.
        self._outbox: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        # Messages put in the outbox and sent from it, counts that only grow: flush() waits for the second to reach
        # what the first was (a flush that timed out, or two at once, cannot leave the other waiting on the wrong one).
        self._queued = 0
        self._sent = 0
        self._sending = threading.Condition()  # guards _sent
        self._lifecycle = threading.Lock()  # start() and stop(); not _lock, which the HTTP handlers take
        self._drop = 0
        self._running: list[FakeRequest] = []
        self._extra_running = 0
        self._waiting = 0
        self._context: zmq.Context[Any] | None = None
        self._io_thread: threading.Thread | None = None
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._metrics_fault: tuple[str | None, float, float | None] = (None, 0.0, None)
        self.endpoint = ""
        self.replay_endpoint = ""
        self.url = ""
        self._started_at = 0.0  # process_start_time_seconds: each restart a later one
        self._new_metrics()

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> FakeVLLM:
        """Bind the sockets and the HTTP server on free ports and start serving; return self. A restart is
        :meth:`stop`, then ``start()``.

        Raises:
            StateError: the engine is serving already (a second server would leave the first one's threads and
                sockets with nothing to stop them).
        """
        with self._lifecycle:
            if self._context is not None:
                raise StateError(f"the fake engine is serving already, at {self.url}: stop() it first")
            try:
                self._start()
            except BaseException:  # e.g. a port taken: nothing left running, so a later start() may try again
                self._shut()
                raise
        return self

    def _start(self) -> None:
        self._context = zmq.Context()
        pub = self._context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 1_000_000)
        pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(pub, self._host, self._ports[0])
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        self.replay_endpoint = _bind(router, self._host, self._ports[1])
        self._stop.clear()
        self._io_thread = threading.Thread(
            target=self._serve_zmq, args=(pub, router), name="fake-vllm-zmq", daemon=True
        )
        self._io_thread.start()
        self._http = ThreadingHTTPServer((self._host, 0), _handler_for(self))
        self._http.daemon_threads = True
        self.url = f"http://{self._host}:{self._http.server_address[1]}"
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="fake-vllm-http", daemon=True)
        self._http_thread.start()

    def stop(self) -> None:
        """Stop serving and close every socket. Idempotent, also from several threads at once."""
        with self._lifecycle:
            self._shut()

    def _shut(self) -> None:
        self._stop.set()  # the ZMQ thread sees it within a millisecond
        if self._io_thread is not None:
            self._io_thread.join(5)
            self._io_thread = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the engine ------------------------------------------------------------------------------------------------

    @property
    def seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._seq

    def complete(
        self, prompt: list[int], *, lora_name: str | None = None, share: bool = True, hold: bool = False
    ) -> Completion:
        """Serve one prompt: hit the cache, store new blocks, record metrics, publish the events.

        ``share=False`` schedules it as if alongside an identical request (its blocks become duplicate copies);
        ``hold=True`` keeps it running (its blocks stay referenced) until :meth:`finish_all`.

        Raises:
            ConfigurationError: ``share`` or ``hold`` is not a bool, or ``lora_name`` not None nor an adapter's name
                (nothing changes).
            InvalidTypeError, InvalidPromptError: as :meth:`FakeBlockCache.allocate` (nothing changes).
        """
        check_flag(share, "share")
        check_flag(hold, "hold")
        with self._lock:
            request = self.cache.allocate(prompt, lora_name=lora_name, share=share)
            ttft = self._ttft(request.cached_tokens, request.prompt_tokens, self._waiting)
            self._m_ttft.observe(ttft)
            self._m_queries.inc(request.prompt_tokens)
            self._m_hits.inc(request.cached_tokens)
            if hold:
                self._running.append(request)
            else:
                self.cache.free(request)
            self._publish()
            return Completion(request.prompt_tokens, request.cached_tokens, ttft)

    def finish_all(self) -> None:
        """Finish every held request (their blocks become evictable)."""
        with self._lock:
            for request in self._running:
                self.cache.free(request)
            self._running.clear()

    def clear_cache(self) -> None:
        """Reset the prefix cache (publishes ``AllBlocksCleared``)."""
        with self._lock:
            self.cache.clear()
            self._publish()

    def restart(self) -> None:
        """Simulate a process restart: empty cache, new hash seed, sequence from 0, empty replay buffer, new metrics."""
        with self._lock:
            self._running.clear()
            self.cache.reset()
            self._seq = 0
            self._buffer.clear()
            self._new_metrics()

    def flush(self, *, timeout: float = 10.0) -> None:
        """Wait until every batch published so far has been sent on the PUB socket (a subscriber that connects
        afterwards cannot receive them live: it has to replay them).

        Raises:
            ConfigurationError: ``timeout`` is not a finite number of seconds >= 0 (nothing is waited for).
            TimeoutError: the batches were not all sent within ``timeout``.
        """
        timeout = _wait_seconds(timeout, "timeout")
        with self._lock:
            queued = self._queued
        with self._sending:
            if not self._sending.wait_for(lambda: self._sent >= queued, timeout):
                raise TimeoutError(f"the fake engine did not send its batches within {timeout}s")

    def drop_next(self, count: int = 1) -> None:
        """Lose the next ``count`` published messages on the PUB socket (they stay replayable).

        Raises:
            ConfigurationError: ``count`` is not an int in [0, 2**31].
        """
        number = _count(count, "count")
        with self._lock:
            self._drop += number

    def set_load(self, *, running: int = 0, waiting: int = 0) -> None:
        """Report ``running`` extra running and ``waiting`` queued requests (waiting also slows TTFT).

        Raises:
            ConfigurationError: either is not an int in [0, 2**31] (nothing changes; ``/metrics`` would fail on it).
        """
        extra, queued = _count(running, "running"), _count(waiting, "waiting")
        with self._lock:
            self._extra_running = extra
            self._waiting = queued

    def set_metrics_fault(self, *, text: str | None = None, delay: float = 0.0, trickle: float | None = None) -> None:
        """Make ``/metrics`` misbehave: serve ``text`` instead of the real figures (None: the real ones), answer
        after ``delay`` seconds, and with ``trickle`` send the body one byte every ``trickle`` seconds. Call with no
        arguments to behave again. Requests already being answered keep their fault; :meth:`stop` ends them.

        Raises:
            ConfigurationError: ``text`` is not a str or None, ``delay`` not a finite number of seconds >= 0,
                ``trickle`` neither None nor one (checked here, not by the request that would meet the fault; the
                fault set before stays).
        """
        if text is not None and not isinstance(text, str):
            raise ConfigurationError(f"text must be the /metrics body (a str) or None, not {shown(text)}")
        seconds = _wait_seconds(delay, "delay")
        every = None if trickle is None else _wait_seconds(trickle, "trickle", none=True)
        with self._lock:
            self._metrics_fault = (text, seconds, every)

    def metrics_fault(self) -> tuple[str | None, float, float | None]:
        """The fault set by :meth:`set_metrics_fault`: ``(text, delay, trickle)``."""
        with self._lock:
            return self._metrics_fault

    def publish_payload(self, payload: bytes) -> None:
        """Publish ``payload`` as the next batch, numbered and kept for replay as a real one (e.g. corrupt bytes).

        Raises:
            InvalidTypeError: ``payload`` is not bytes (nothing is published).
        """
        payload = _frame(payload, "payload")
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            self._queued += 1
            self._outbox.put([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    def publish_raw(self, frames: list[bytes]) -> None:
        """Send ``frames`` as one message on the PUB socket, as they are (not numbered, not buffered for replay).

        Raises:
            InvalidTypeError: ``frames`` is not a list of bytes (nothing is sent).
            ConfigurationError: ``frames`` is empty (nothing is sent).
        """
        if not isinstance(frames, (list, tuple)):
            raise InvalidTypeError(f"frames must be a list of bytes frames, not {type(frames).__name__}")
        if not frames:  # ZMQ has no message of no frames: sending one would end the publisher thread
            raise ConfigurationError("frames is empty: a message needs at least one frame, e.g. [b'']")
        message = [_frame(frame, f"frames[{i}]") for i, frame in enumerate(frames)]
        with self._lock:
            self._queued += 1
            self._outbox.put(message)

    def observe_ttft(self, seconds: float) -> None:
        """Record one TTFT sample directly.

        Raises:
            ConfigurationError: ``seconds`` is not a finite number >= 0 (nothing is recorded).
        """
        sample = as_float(seconds)
        if sample is None or sample < 0:
            raise ConfigurationError(f"seconds must be a finite number >= 0, not {shown(seconds)}")
        with self._lock:
            self._m_ttft.observe(sample)

    def chains(self) -> list[CachedChain]:
        """The true cache contents, one token chain per cached block."""
        with self._lock:
            return self.cache.chains()

    def own_hashes(self, *, block_size: int = 16, namespace: str | bytes | None = None) -> set[int]:
        """The true cache contents as prefixroute block hashes."""
        with self._lock:
            return self.cache.own_hashes(block_size=block_size, namespace=namespace)

    def metrics_text(self) -> str:
        """Return the Prometheus text ``/metrics`` serves."""
        with self._lock:
            running = len(self._running) + self._extra_running
            self._m_running.set(running)
            self._m_waiting.set(self._waiting)
            self._m_usage.set(self.cache.usage())
            text: str = generate_latest(self._registry).decode()
            return text

    # -- internals -------------------------------------------------------------------------------------------------

    def _created(self) -> int:
        """``created`` of an answer: ``clock()`` in whole seconds (0 for a clock that raises or returns no finite
        number, which a test may set for the batches' stamps: an answer is still made)."""
        try:
            stamp = as_float(self._clock())
        except Exception:  # the clock is the test's: the batches it stamps report it
            stamp = None
        return 0 if stamp is None else int(stamp)

    def _permission_ids(self) -> Iterator[str]:
        """Ids for ``/v1/models``' permissions, as vLLM's ``modelperm-<uuid4 hex>``, from the engine's seed."""
        while True:
            with self._lock:  # not held across a yield
                bits = self._ids.getrandbits(128)
            yield f"modelperm-{bits:032x}"

    def _publish(self) -> None:
        if not self.cache.events:
            return
        # Read before the events are taken: a clock that raises or returns no number loses none of them (the next
        # batch carries them). A float is taken as it is, NaN too (a test may want one on the wire).
        stamp = self._clock()
        if not (isinstance(stamp, float) or as_float(stamp) is not None):
            raise InvalidTypeError(
                f"clock() returned {shown(stamp)}: it must return seconds since the epoch, a float as time.time() does"
            )
        events = self.cache.take_events()
        seq = self._seq
        self._seq += 1
        alternate: Literal["array", "map"] = "map" if seq % 2 else "array"
        encoding = alternate if self.encoding == "alternate" else self.encoding
        payload = encode_batch(EventBatch(float(stamp), events, 0), encoding=encoding)
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
        else:
            self._queued += 1
            self._outbox.put([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    def _serve_zmq(self, pub: zmq.Socket[Any], router: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        item = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    pub.send_multipart(item)
                    with self._sending:
                        self._sent += 1
                        self._sending.notify_all()
                if poller.poll(1):
                    self._serve_replay(router)
        finally:
            pub.close(linger=0)
            router.close(linger=0)

    def _serve_replay(self, router: zmq.Socket[Any]) -> None:
        frames = router.recv_multipart()
        if len(frames) != 3:  # as vLLM: dropped unanswered; a start of any length is read as big-endian bytes
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with self._lock:
            buffered = [item for item in self._buffer if item[0] >= start] if self._replay_enabled else []
        topic = [self.topic.encode()] if self._replay_topic else []
        for seq, payload in buffered:
            router.send_multipart([identity, b"", *topic, seq.to_bytes(8, "big"), payload])
        # vLLM (vllm#45177) ends a topic-framed replay with an empty topic frame: [b"", END, b""]
        router.send_multipart([identity, b"", *([b""] if topic else []), _END_OF_REPLAY, b""])

    def _new_metrics(self) -> None:
        registry = self._registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = {"model_name": self.model, "engine": "0"}
        prefix = "vllm:gpu_" if self.legacy_metric_names else "vllm:"
        self._m_running = Gauge("vllm:num_requests_running", "Running requests.", labels, registry=registry)
        self._m_waiting = Gauge("vllm:num_requests_waiting", "Waiting requests.", labels, registry=registry)
        usage = "vllm:gpu_cache_usage_perc" if self.legacy_metric_names else "vllm:kv_cache_usage_perc"
        self._m_usage = Gauge(usage, "KV cache usage (1 = full).", labels, registry=registry)
        self._m_queries = Counter(f"{prefix}prefix_cache_queries", "Prompt tokens queried.", labels, registry=registry)
        self._m_hits = Counter(f"{prefix}prefix_cache_hits", "Prompt tokens hit.", labels, registry=registry)
        self._m_ttft = Histogram(
            "vllm:time_to_first_token_seconds", "TTFT.", labels, buckets=TTFT_BUCKETS, registry=registry
        )
        # What prometheus_client's process collector exports on vLLM's default registry: a restart changes it.
        started = Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                        registry=registry)  # fmt: skip
        self._started_at = max(time.time(), self._started_at + 0.01)
        started.set(self._started_at)
        config_labels = ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"]  # vLLM's log_metrics_info:
        info = Gauge("vllm:cache_config_info", "Cache config.", config_labels, registry=registry)  # config and engine
        info.labels(str(self.cache.block_size), str(self.cache.num_blocks), "True", "0").set(1)
        self._m_running = self._m_running.labels(**values)
        self._m_waiting = self._m_waiting.labels(**values)
        self._m_usage = self._m_usage.labels(**values)
        self._m_queries = self._m_queries.labels(**values)
        self._m_hits = self._m_hits.labels(**values)
        self._m_ttft = self._m_ttft.labels(**values)


def _bind(socket: zmq.Socket[Any], host: str, port: int) -> str:
    """Bind to ``port`` (0: a free port the OS picks); return the endpoint to connect to."""
    if port == 0:
        port = socket.bind_to_random_port(f"tcp://{host}")
    else:
        socket.bind(f"tcp://{host}:{port}")
    return f"tcp://{host}:{port}"


def _handler_for(engine: FakeVLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?")[0]
            if path == "/v1/models":  # vLLM's model list: the base model's card
                listing = model_list(
                    engine.model, (), created=engine._created(), permission_ids=engine._permission_ids()
                )
                self._reply(200, json_body(listing), JSON)
                return
            if path == "/health":  # vLLM's health check: an empty 200 (Response(status_code=200)) while it runs
                self._reply(200, b"", None)
                return
            if not path.startswith("/metrics"):
                self._refuse(path)
                return
            self._metrics()

        def _metrics(self) -> None:
            """``/metrics``: as vLLM mounts its Prometheus app, at every path that starts so and for every method."""
            text, delay, trickle = engine.metrics_fault()
            body = (engine.metrics_text() if text is None else text).encode()
            if delay and engine._stop.wait(delay):  # stop() ends the wait: a long delay holds no thread past it
                return
            if trickle is None:
                self._reply(200, body, "text/plain; version=0.0.4; charset=utf-8")
                return
            self._head(200, "text/plain; version=0.0.4; charset=utf-8", len(body), {})
            if self.command == "HEAD":
                return
            try:
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    if engine._stop.wait(trickle):
                        return
            except OSError:  # the client gave up
                return

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path.startswith("/metrics"):
                self._metrics()
                return
            if path != "/v1/completions":
                self._refuse(path)
                return
            try:
                body = json_object(self._body())
                prompts = _token_prompts(body.get("prompt"))
                check_types(body)
                # vLLM's CompletionRequest: max_tokens 16 unless given
                max_tokens = read_max_tokens(body.get("max_tokens"), 16, max(map(len, prompts)))
            except (ValueError, TypeError) as exc:  # vLLM's ErrorResponse
                self._reply(400, json_body(error_body(exc)), JSON)
                return
            missing = model_not_found(body.get("model"), (engine.model,))
            if missing is not None:
                self._reply(404, json_body(missing), JSON)
                return
            # vLLM's _base_request_id: the client's X-Request-Id, else the body's request_id, else a random one
            request_id = self.headers.get("X-Request-Id", body.get("request_id"))
            if request_id is None:
                with engine._lock:
                    request_id = f"{engine._ids.getrandbits(128):032x}"  # as vLLM's random_uuid(), seeded
            done = [engine.complete(prompt) for prompt in prompts]
            prompt_tokens = sum(c.prompt_tokens for c in done)
            cached_tokens = sum(c.cached_tokens for c in done)
            text = "".join(f" t{i}" for i in range(max_tokens))
            # vLLM's CompletionResponse; prompt_tokens_details as with --enable-prompt-tokens-details: null when no
            # prompt token came from the cache
            reply = {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "created": engine._created(),
                "model": engine.model,
                "choices": [
                    {
                        "index": i,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                    for i in range(len(done))
                ],  # fmt: skip
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens * len(done),
                    "total_tokens": prompt_tokens + max_tokens * len(done),
                    "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
                },
            }
            self._reply(200, json_body(reply), JSON)

        def _body(self) -> bytes:
            """The request's body as vLLM's server (uvicorn) reads it: ``Content-Length`` bytes, or a body sent
            ``Transfer-Encoding: chunked`` decoded (http.server reads neither for us)."""
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return _dechunk(self.rfile)
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))

        def _other(self) -> None:
            """A method no route of vLLM's takes but its Prometheus app (every method under ``/metrics``):
            CORSMiddleware's 200 to a preflight on any path, else FastAPI's 404 or 405 (HEAD too: FastAPI adds no
            HEAD to a GET route)."""
            path = self.path.split("?")[0]
            if is_preflight(self.command, self.headers):  # CORSMiddleware wraps every route, /metrics too
                requested = self.headers.get("Access-Control-Request-Headers")
                self._reply(200, PREFLIGHT_BODY, "text/plain; charset=utf-8", preflight_headers(requested))
            elif path.startswith("/metrics"):
                self._metrics()
            else:
                self._refuse(path)

        do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other  # noqa: N815 - http.server's naming

        def _refuse(self, path: str) -> None:
            """FastAPI's answer to a path vLLM does not serve (404), or serves with another method (405), and
            Starlette's (``redirect_slashes``) to a path it serves without trailing slashes: an empty 307 there."""
            allowed = _ROUTES.get(path)
            if allowed is not None:
                self._reply(405, METHOD_NOT_ALLOWED, JSON, {"Allow": allowed})
                return
            location = slash_redirect(
                unquote(path),  # as Starlette routes it, percent-decoded
                routes=_ROUTES,
                scheme="http",
                host=self.headers.get("Host", ""),
                local=self.connection.getsockname(),
                query=self.path.partition("?")[2],
            )
            if location is None:
                self._reply(404, NOT_FOUND, JSON)
            else:
                self._reply(307, b"", None, {"Location": location})

        def _reply(
            self, status: int, body: bytes, content_type: str | None, headers: Mapping[str, str] | None = None
        ) -> None:
            """Answer ``body`` (its length, but no body, to a HEAD), with CORSMiddleware's header if it adds one."""
            self._head(status, content_type, len(body), headers or {})
            if self.command == "HEAD":
                return
            try:
                self.wfile.write(body)
            except OSError:  # the client gave up (a timeout in a test): nothing to tell it
                return

        def _head(self, status: int, content_type: str | None, length: int, headers: Mapping[str, str]) -> None:
            self.send_response(status)
            if content_type is not None:  # None: an answer with no body, which Starlette labels with none
                self.send_header("Content-Type", content_type)
            for name, value in {**headers, **cors_headers(self.headers)}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(length))
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet in tests
            return

    return Handler


def _dechunk(stream: io.BufferedIOBase) -> bytes:
    """Read a chunked body (RFC 9112 section 7.1) from ``stream``: chunks of a hex size (an extension after ``;`` is
    ignored) up to the empty last one, then its trailer lines, which are skipped. O(body).

    Raises:
        ValueError: a size line that is no hex number, or a body cut short (the request is a 400).
    """
    parts = []
    while True:
        line = stream.readline(_MAX_LINE)
        size = int(line.split(b";", 1)[0].strip(), 16)  # ValueError for a line that is no size
        if size == 0:
            break
        part = stream.read(size)
        if len(part) != size or stream.readline(_MAX_LINE).strip():
            raise ValueError("the chunked request body was cut short or malformed")
        parts.append(part)
    while stream.readline(_MAX_LINE).strip():  # trailer fields, up to the empty line that ends the request
        pass
    return b"".join(parts)


def _token_prompts(prompt: object) -> list[list[int]]:
    """Accept ``[ids]`` or ``[[ids], …]`` (the token-id forms of the OpenAI completions API; the fake reads no text).

    Raises:
        Invalid: no prompt, null or ``""`` (vLLM's model validator, located at the body), or one that is neither a
            list nor a str (pydantic's, ``param`` ``body.prompt``).
        ValueError: any other prompt the fake does not serve.
    """
    if prompt is None or prompt == "":
        raise Invalid("Either prompt or prompt_embeds must be provided and non-empty.", param="body")
    if not isinstance(prompt, (list, str)):
        raise Invalid("prompt must be a non-empty list of token ids or a list of such lists", param="body.prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt:
        prompts = [prompt]
    else:
        raise ValueError("prompt must be a non-empty list of token ids or a list of such lists")
    for p in prompts:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in p):
            raise ValueError("token ids must be ints in [0, 2**32)")
    return [list(p) for p in prompts]


def _wait_seconds(value: object, name: str, *, none: bool = False) -> float:
    """``value`` as a plain float if it is a finite number of seconds >= 0 that a thread can wait (at most
    :data:`~prefixroute.vllm._checks.MAX_SECONDS`), else ConfigurationError naming ``name`` (``none``: the message
    says None is taken too)."""
    seconds = as_float(value)
    if seconds is None or not 0 <= seconds <= MAX_SECONDS:
        also = "None or " if none else ""
        raise ConfigurationError(
            f"{name} must be {also}a finite number of seconds >= 0 (at most {MAX_SECONDS:.0f}), not {shown(value)}"
        )
    return seconds


def _count(value: object, name: str) -> int:
    """``value`` as a count in [0, 2**31], else ConfigurationError naming ``name``."""
    number = as_int(value)
    if number is None or not 0 <= number <= 2**31:
        raise ConfigurationError(f"{name} must be an int in [0, 2**31], not {shown(value)}")
    return number
