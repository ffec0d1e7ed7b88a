"""Every option of prefixroute.testing's public classes (FakeVLLM, FakeBlockCache, OpenAIEngine and their methods)
refuses a value it cannot use, whatever its type, with a ConfigurationError naming the option (errors.py's rule), when
it is given: not later, in an I/O thread, nor as a TypeError for a value of the wrong type."""

from __future__ import annotations

import inspect
import itertools
import math
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from prefixroute import ConfigurationError, InvalidPromptError, InvalidTypeError, StateError
from prefixroute._numbers import shown
from prefixroute.testing import FakeBlockCache, FakeVLLM
from prefixroute.testing.openai_engine import OpenAIEngine
from prefixroute.vllm._checks import MAX_SECONDS
from prefixroute.vllm.events import EventDecoder

from .test_flag_options import FLAGS

_SECONDS = "must be a finite number of seconds >= 0 (at most "
_NO_NUMBERS: list[Any] = ["1", None, True, -1, math.nan, math.inf, 10**400, [1]]
_NO_COUNTS: list[Any] = ["1", None, True, -1, 1.5, 1.0, 2**31 + 1, [1]]
_NO_TEXTS: list[Any] = [5, 1.5, True, b"x", ["x"]]
_NO_SIZES: list[Any] = [0, "1", None, True, -1, 1.5, 1.0, [1]]

npa: Any = np  # numpy's scalars typed loosely: numpy 2.2's stubs (Python 3.10's) refuse np.int64 as int, 2.4's not


def _fake() -> FakeVLLM:
    return FakeVLLM()  # built, never started: every option is checked when it is given


def _cache(**options: Any) -> FakeBlockCache:
    return FakeBlockCache(rng=random.Random(0), **options)


# ``Name(option=)``: (a call giving the option a value, values it cannot use, the start of the message). The
# message names the option; the value refused is in it too.
OPTIONS: dict[str, tuple[Callable[[Any], object], list[Any], str]] = {
    "FakeVLLM(block_size=)": (lambda v: FakeVLLM(block_size=v), _NO_SIZES, "block_size must be a positive int"),
    "FakeVLLM(num_blocks=)": (lambda v: FakeVLLM(num_blocks=v), _NO_SIZES, "num_blocks must be a positive int"),
    "FakeVLLM(model=)": (lambda v: FakeVLLM(model=v), [*_NO_TEXTS, None, "", " "], "model must"),
    # A lone surrogate in topic or host: was taken, then every request that stored blocks, or the start, failed on it.
    "FakeVLLM(topic=)": (lambda v: FakeVLLM(topic=v), [*_NO_TEXTS, None, "kv\ud800"], "topic must be "),
    "FakeVLLM(encoding=)": (lambda v: FakeVLLM(encoding=v), [*_NO_TEXTS, None, "json"], "encoding must be 'array'"),
    "FakeVLLM(hash_format=)": (lambda v: FakeVLLM(hash_format=v), [*_NO_TEXTS, None, "hex"], "hash_format must be"),
    "FakeVLLM(replay_buffer=)": (lambda v: FakeVLLM(replay_buffer=v), _NO_COUNTS, "replay_buffer must be an int"),
    "FakeVLLM(seed=)": (lambda v: FakeVLLM(seed=v), ["1", None, True, 1.5, 1.0, [1]], "seed must be an int"),
    "FakeVLLM(host=)": (lambda v: FakeVLLM(host=v), [*_NO_TEXTS, None, "127.0.0.1\udfff"], "host must be "),
    "FakeVLLM(port=)": (lambda v: FakeVLLM(port=v), [*_NO_COUNTS, 65536], "port and replay_port must be ints"),
    "FakeVLLM(replay_port=)": (lambda v: FakeVLLM(replay_port=v), [*_NO_COUNTS, 65536], "port and replay_port"),
    "FakeVLLM.complete(lora_name=)": (
        lambda v: _fake().complete(list(range(32)), lora_name=v), [*_NO_TEXTS, ""], "lora_name must be"),
    "FakeVLLM.drop_next(count=)": (lambda v: _fake().drop_next(v), _NO_COUNTS, "count must be an int in [0, 2**31]"),
    "FakeVLLM.flush(timeout=)": (lambda v: _fake().flush(timeout=v), _NO_NUMBERS, "timeout " + _SECONDS),
    "FakeVLLM.observe_ttft(seconds=)": (lambda v: _fake().observe_ttft(v), _NO_NUMBERS, "seconds must be a finite"),
    "FakeVLLM.set_load(running=)": (lambda v: _fake().set_load(running=v), _NO_COUNTS, "running must be an int"),
    "FakeVLLM.set_load(waiting=)": (lambda v: _fake().set_load(waiting=v), _NO_COUNTS, "waiting must be an int"),
    "FakeVLLM.set_metrics_fault(text=)": (
        lambda v: _fake().set_metrics_fault(text=v), _NO_TEXTS, "text must be the /metrics body (a str) or None"),
    "FakeVLLM.set_metrics_fault(delay=)": (
        lambda v: _fake().set_metrics_fault(delay=v), _NO_NUMBERS, "delay " + _SECONDS),
    "FakeVLLM.set_metrics_fault(trickle=)": (
        lambda v: _fake().set_metrics_fault(trickle=v), [x for x in _NO_NUMBERS if x is not None],
        "trickle must be None or a finite number of seconds >= 0"),
    "FakeVLLM.own_hashes(block_size=)": (lambda v: _fake().own_hashes(block_size=v), _NO_SIZES, "block_size"),
    "FakeBlockCache(block_size=)": (lambda v: _cache(block_size=v), _NO_SIZES, "block_size must be"),
    "FakeBlockCache(num_blocks=)": (lambda v: _cache(num_blocks=v), _NO_SIZES, "num_blocks must be"),
    "FakeBlockCache(hash_format=)": (lambda v: _cache(hash_format=v), [*_NO_TEXTS, None, "hex"], "hash_format must"),
    "FakeBlockCache.allocate(lora_name=)": (
        lambda v: _cache().allocate(list(range(32)), lora_name=v), [*_NO_TEXTS, ""], "lora_name must be"),
    "FakeBlockCache.own_hashes(block_size=)": (lambda v: _cache().own_hashes(block_size=v), _NO_SIZES,
                                               "block_size"),
    "OpenAIEngine(model=)": (lambda v: OpenAIEngine(model=v), [*_NO_TEXTS, None, ""], "model must"),
    "OpenAIEngine(lora_adapters=)": (
        lambda v: OpenAIEngine(lora_adapters=v), [5, None, "sql", b"sql", [5], [None], ["a", "a"], [""]],
        "lora_adapters "),
    "OpenAIEngine(block_size=)": (lambda v: OpenAIEngine(block_size=v), _NO_SIZES, "block_size must be"),
    "OpenAIEngine(num_blocks=)": (lambda v: OpenAIEngine(num_blocks=v), _NO_SIZES, "num_blocks must be"),
    "OpenAIEngine(prefill_s=)": (lambda v: OpenAIEngine(prefill_s=v), _NO_NUMBERS, "prefill_s must be a finite"),
    "OpenAIEngine(prefill_per_token_s=)": (
        lambda v: OpenAIEngine(prefill_per_token_s=v), _NO_NUMBERS, "prefill_per_token_s must be a finite"),
    "OpenAIEngine(token_delay_s=)": (
        lambda v: OpenAIEngine(token_delay_s=v), _NO_NUMBERS, "token_delay_s must be a finite"),
    "OpenAIEngine(max_tokens=)": (lambda v: OpenAIEngine(max_tokens=v), _NO_SIZES, "max_tokens and max_running"),
    "OpenAIEngine(max_running=)": (
        lambda v: OpenAIEngine(max_running=v), [x for x in _NO_SIZES if x is not None], "max_tokens and"),
    "OpenAIEngine(seed=)": (lambda v: OpenAIEngine(seed=v), ["1", None, True, 1.5, 1.0, [1]], "seed must be an int"),
    "OpenAIEngine(host=)": (lambda v: OpenAIEngine(host=v), [*_NO_TEXTS, None], "host must be a str"),
    "OpenAIEngine(port=)": (lambda v: OpenAIEngine(port=v), [*_NO_COUNTS, 65536], "port must be an int in [0, 65535]"),
    "OpenAIEngine.fail_next(count=)": (
        lambda v: OpenAIEngine().fail_next(v), _NO_COUNTS, "count must be an int in [0, 2**31]"),
    "OpenAIEngine.fail_next(status=)": (
        lambda v: OpenAIEngine().fail_next(status=v), [200, 399, 600, "500", 500.0, None, True],
        "status must be an HTTP error status, an int in [400, 599]"),
    "OpenAIEngine.stall(after_tokens=)": (
        lambda v: OpenAIEngine().stall(after_tokens=v), _NO_COUNTS, "after_tokens must be an int in [0, 2**31]"),
}  # fmt: skip

# Options that take an object the fake calls (a callable, a random.Random): a wrong one is an InvalidTypeError, a
# TypeError, as Router's clock and rng, the subscriber's clock and every other such option of the library are.
COLLABORATORS = {"FakeVLLM(ttft=)", "FakeVLLM(clock=)", "FakeBlockCache(rng=)", "OpenAIEngine(tokenizer=)",
                 "OpenAIEngine(clock=)"}  # fmt: skip
# own_hashes(namespace=) is the hasher's: a str, bytes or None, else InvalidTypeError, as BlockHasher,
# Router.add_backend and the subscriber take it.
LIBRARY_WIDE = {"FakeVLLM.own_hashes(namespace=)", "FakeBlockCache.own_hashes(namespace=)"}
TESTING_FLAGS = {name for name in FLAGS if name.startswith(("FakeVLLM", "FakeBlockCache", "OpenAIEngine"))}


def _options_of(cls: type) -> set[str]:
    """``Class(option=)`` and ``Class.method(option=)`` for every parameter with a default (and ``rng``, which has
    none) of the class's constructor and public methods."""
    found = set()
    for name, function in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        where = cls.__name__ if name == "__init__" else f"{cls.__name__}.{name}"
        for parameter in inspect.signature(function).parameters.values():
            if parameter.default is not inspect.Parameter.empty or parameter.name == "rng":
                found.add(f"{where}({parameter.name}=)")
    return found


def test_every_option_of_the_testing_classes_is_listed_here() -> None:
    options = _options_of(FakeVLLM) | _options_of(FakeBlockCache) | _options_of(OpenAIEngine)
    samples = {"FakeVLLM.observe_ttft(seconds=)"}  # no option but a sample, checked as RouterMetrics.observe's is
    assert options | samples == set(OPTIONS) | COLLABORATORS | LIBRARY_WIDE | TESTING_FLAGS


@pytest.mark.parametrize("name", OPTIONS)
def test_an_option_refuses_what_it_cannot_use_with_a_configuration_error(name: str) -> None:
    give, bads, message = OPTIONS[name]
    for bad in bads:
        with pytest.raises(ConfigurationError) as refused:
            give(bad)
        text = str(refused.value)
        assert text.startswith(message), (bad, text)
        if not isinstance(bad, list):  # a list's elements may be what is named ("lists 'a' twice")
            assert shown(bad) in text or repr(bad) in text or type(bad).__name__ in text, (bad, text)


@pytest.mark.parametrize("name", sorted(COLLABORATORS))
def test_an_option_that_takes_a_callable_or_rng_refuses_another_object_with_a_type_error(name: str) -> None:
    cls, option = name.split("(")[0], name.split("(")[1].rstrip("=)")
    make = {"FakeVLLM": FakeVLLM, "FakeBlockCache": FakeBlockCache, "OpenAIEngine": OpenAIEngine}[cls]
    with pytest.raises(InvalidTypeError, match=option):
        make(**{option: 5})


def test_refused_test_hooks_change_nothing() -> None:
    engine = FakeVLLM()
    engine.set_metrics_fault(text="x 1\n", delay=0.5, trickle=0.01)
    for options in ({"text": 5}, {"delay": -1}, {"trickle": math.inf}, {"text": "y", "delay": "soon"}):
        with pytest.raises(ConfigurationError):
            engine.set_metrics_fault(**options)
    assert engine.metrics_fault() == ("x 1\n", 0.5, 0.01)
    fake = OpenAIEngine()
    fake.fail_next(2, status=503)
    with pytest.raises(ConfigurationError):
        fake.fail_next(1, status=200)
    assert fake._fail == (2, 503)


def test_good_values_are_taken_as_the_plain_numbers_they_stand_for() -> None:
    engine = FakeVLLM()
    engine.flush(timeout=npa.float32(0.5))
    engine.flush(timeout=0)
    engine.set_metrics_fault(delay=npa.int64(1), trickle=npa.float64(0.25))
    assert engine.metrics_fault() == (None, 1.0, 0.25) and type(engine.metrics_fault()[1]) is float
    engine.set_metrics_fault(delay=MAX_SECONDS, trickle=MAX_SECONDS)  # the bounds the messages state are taken
    assert engine.metrics_fault() == (None, MAX_SECONDS, MAX_SECONDS)
    engine.drop_next(2**31)
    for bound in ({"replay_buffer": 0}, {"replay_buffer": 2**31}, {"port": 65535, "replay_port": 65534}):
        FakeVLLM(**bound)  # type: ignore[arg-type]
    engine.set_metrics_fault()
    assert engine.metrics_fault() == (None, 0.0, None)
    assert engine.complete(list(range(32)), lora_name="sql").prompt_tokens == 32
    for whole_seconds in (1_700_000_000, npa.int64(1_700_000_000)):  # such a clock's batches are stamped with it
        stamped = FakeVLLM(clock=itertools.repeat(whole_seconds).__next__)
        stamped.complete(list(range(32)))
        assert EventDecoder().decode(stamped._buffer[-1][1]).ts == 1_700_000_000.0
    fake = OpenAIEngine(seed=npa.int64(3), host="localhost")
    fake.fail_next(npa.int64(1), status=npa.int64(429))
    fake.stall(after_tokens=npa.int64(2))
    assert fake._fail == (1, 429) and type(fake._fail[1]) is int and fake._stall_after == 2


@pytest.mark.parametrize(
    ("encoding", "maps"),
    [("array", [False] * 4), ("map", [True] * 4), ("alternate", [False, True, False, True])],
)
def test_each_batch_is_encoded_as_the_engine_was_told(encoding: Any, maps: list[bool]) -> None:
    """Events as tagged arrays (vLLM before #42892) or maps (after), or switching per batch (from an array): a
    subscriber decodes either, so only the payloads show which the fake sent."""
    engine = FakeVLLM(encoding=encoding)
    for start in range(4):
        engine.complete(list(range(start * 100, start * 100 + 16)))
    decoded = [EventDecoder().decode(payload) for _, payload in engine._buffer]
    assert [type(batch.events[0]).__name__.startswith("_Map") for batch in decoded] == maps
    assert all(batch.data_parallel_rank == 0 for batch in decoded)  # vLLM's publisher stamps its rank


def test_a_frame_zmq_cannot_send_is_refused_and_the_publisher_thread_goes_on() -> None:
    # Was: publish_payload("text") or publish_raw([5]) queued the frame; the publisher thread died sending it and
    # every later batch was lost (flush() timed out).
    with FakeVLLM() as engine:
        for publish in (engine.publish_payload, lambda bad: engine.publish_raw([b"topic", bad])):
            for bad in (None, "text", 5, [b"x"]):
                with pytest.raises(InvalidTypeError, match="must be bytes, not"):
                    publish(bad)  # type: ignore[arg-type]
        for frames in (None, b"frame", "frames"):
            with pytest.raises(InvalidTypeError, match="frames must be a list of bytes frames"):
                engine.publish_raw(frames)  # type: ignore[arg-type]
        engine.publish_payload(bytearray(b"\x00corrupt"))  # type: ignore[arg-type]  # bytes-like: sent as bytes
        engine.publish_raw([b"", memoryview(b"x")])  # type: ignore[list-item]
        assert engine.complete(list(range(64))).prompt_tokens == 64
        engine.flush(timeout=10)  # every batch sent: the thread lives


def test_a_message_of_no_frames_is_refused_and_the_publisher_thread_goes_on() -> None:
    # Was: publish_raw([]) queued it; the publisher thread died sending it (IndexError in pyzmq's send_multipart)
    # and every later batch was lost (found by a live audit).
    with FakeVLLM() as engine:
        with pytest.raises(ConfigurationError, match="a message needs at least one frame"):
            engine.publish_raw([])
        assert engine.complete(list(range(64))).prompt_tokens == 64
        engine.flush(timeout=10)  # every batch sent: the thread lives


def test_a_prompt_that_is_no_token_ids_and_a_request_from_elsewhere_change_nothing() -> None:
    cache, other = _cache(block_size=4), _cache(block_size=4)
    kept = cache.allocate(list(range(8)))
    stranger = other.allocate(list(range(100, 112)))
    state = (cache.queries, cache.hits, cache.chains(), list(kept.block_ids))
    for bad in (None, "text", 5, [1, None], [-1], iter([1, 2])):
        with pytest.raises((InvalidTypeError, InvalidPromptError)):
            cache.allocate(bad)  # type: ignore[arg-type]
    for request in (None, "request", stranger):
        with pytest.raises((InvalidTypeError, ConfigurationError)):
            cache.free(request)  # type: ignore[arg-type]
    assert (cache.queries, cache.hits, cache.chains(), list(kept.block_ids)) == state
    with pytest.raises(InvalidTypeError):
        FakeVLLM().complete(None)  # type: ignore[arg-type]
    assert (
        cache.allocate(npa.arange(8)).cached_tokens == 4
    )  # numpy token ids, as encode_tokens reads them (all but the last block)
    cache.free(kept)
    cache.free(kept)  # a second free does nothing


def _receives_a_batch(engine: FakeVLLM) -> bool:
    """Whether a subscriber connected to ``engine`` receives the next batch it publishes."""
    context: zmq.Context[Any] = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(engine.endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        engine.publish_payload(b"batch")
        engine.flush(timeout=10)
        return bool(sub.poll(2000))
    finally:
        sub.close(linger=0)
        context.term()


def test_a_fake_engine_stopped_before_it_started_still_publishes_once_started() -> None:
    # Was: stop() woke the ZMQ thread with a None in the outbox; with no thread to take it, the next start's thread
    # took it and ended at once, so nothing was ever published (flush() timed out).
    engine = FakeVLLM()
    engine.stop()
    with engine:
        assert _receives_a_batch(engine)
    with engine:  # and after a stop and a start again
        assert _receives_a_batch(engine)


def test_a_second_start_of_a_fake_engine_is_refused_and_a_failed_one_can_be_retried() -> None:
    before = set(threading.enumerate())
    with FakeVLLM() as engine:
        with pytest.raises(StateError, match=r"the fake engine is serving already, at http://127\.0\.0\.1:\d+: stop"):
            engine.start()
        assert _receives_a_batch(engine)
    assert set(threading.enumerate()) <= before
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        engine = FakeVLLM(replay_port=port)
        with pytest.raises(zmq.ZMQError):
            engine.start()
    assert set(threading.enumerate()) <= before  # nothing left running
    with engine:  # the port is free now
        assert _receives_a_batch(engine)


def test_stop_from_several_threads_at_once_stops_the_fake_engine_once() -> None:
    # Was: each thread passed the checks of stop() before another cleared the fields: an AttributeError on a field
    # already None, or two zmq Context.destroy() calls, which can block for ever.
    failures: list[BaseException] = []

    def stop(engine: FakeVLLM, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            engine.stop()
        except BaseException as exc:  # noqa: BLE001 - every failure is the finding
            failures.append(exc)

    for _ in range(8):
        engine = FakeVLLM().start()
        barrier = threading.Barrier(3)
        stoppers = [threading.Thread(target=stop, args=(engine, barrier), daemon=True) for _ in range(3)]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join(10)
        assert not any(thread.is_alive() for thread in stoppers), "a stop() hung"
        assert failures == []


def test_a_flush_that_timed_out_leaves_no_credit_for_a_later_one() -> None:
    # Was: a flush took the count of batches queued and waited on a semaphore per batch; one that timed out left the
    # batches it had counted to release it later, and the next flush took those and returned before its own went out.
    engine = FakeVLLM()
    engine.complete(list(range(32)))  # not started: the batch waits
    with pytest.raises(TimeoutError, match="did not send its batches within 0.1s"):
        engine.flush(timeout=0.1)
    with engine:
        engine.flush(timeout=10)  # that batch goes out now
    engine.complete(list(range(100, 132)))  # stopped again: this one waits
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        engine.flush(timeout=0.3)
    assert time.monotonic() - started >= 0.3
