"""Black-box checks of prefixroute.vllm against vLLM's wire formats, written from vLLM's own source.

The publisher here is a real pyzmq PUB/ROUTER pair that frames and encodes as vLLM's ``ZmqEventPublisher`` does
(``[topic, 8-byte big-endian seq, msgpack payload]``; a replay ROUTER answering ``[seq, payload]`` or, in newer vLLM,
``[topic, seq, payload]`` and then an end frame of seq -1), with each vLLM version's field layout spelled out by
hand: prefixroute's own encoder is never used, so a disagreement with vLLM cannot hide behind a shared mistake.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
import zmq

from prefixroute import BlockHasher, Router
from prefixroute.cli import main
from prefixroute.errors import MetricsError
from prefixroute.vllm import EventIndex, Fleet, KVEventSubscriber, fetch_metrics, lora_namespace, parse_metrics

from ..conftest import wait_until

BS = 16
TOPIC = b"kv@gpu0"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def tokens(start: int, blocks: int = 1) -> list[int]:
    return list(range(start, start + blocks * BS))


def sha(*parts: object) -> bytes:
    """A 32-byte block hash, as vLLM's sha256 prefix hashing produces."""
    return hashlib.sha256(repr(parts).encode()).digest()


# --- each vLLM version's layout of an event, spelled out --------------------------------------------------------------


def stored_v1(hashes: list[Any], parent: Any, toks: list[int]) -> list[Any]:
    """vLLM 0.9: array_like, tagged, fields up to lora_id."""
    return ["BlockStored", hashes, parent, toks, BS, None]


def stored_v2(hashes: list[Any], parent: Any, toks: list[int]) -> list[Any]:
    """vLLM 0.10: medium appended."""
    return ["BlockStored", hashes, parent, toks, BS, None, "GPU"]


def stored_v3(hashes: list[Any], parent: Any, toks: list[int]) -> list[Any]:
    """lora_name appended, then group metadata (omit_defaults drops trailing defaults)."""
    return ["BlockStored", hashes, parent, toks, BS, None, "GPU", None, None, 0, "full_attention"]


def stored_future_array(hashes: list[Any], parent: Any, toks: list[int]) -> list[Any]:
    """A later version that appends fields prefixroute has never heard of."""
    return [*stored_v3(hashes, parent, toks), None, "LOCAL", "tier0", {"new": [1, 2]}, 7]


def stored_map(hashes: list[Any], parent: Any, toks: list[int]) -> dict[str, Any]:
    """Newer vLLM: events are maps tagged by "type"; fields without a default are always sent, defaults omitted."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": toks,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def stored_map_future(hashes: list[Any], parent: Any, toks: list[int]) -> dict[str, Any]:
    """A later map version: typed extra keys absent, an event_version, locality and fields unknown today."""
    return {
        **stored_map(hashes, parent, toks),
        "event_version": 3,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
        "brand_new": {"x": [1, {"y": None}]},
    }


def removed_array(hashes: list[Any]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]


def removed_array_oldest(hashes: list[Any]) -> list[Any]:
    return ["BlockRemoved", hashes]


def removed_map(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch_array(events: list[Any], ts: float | None = None, rank: int | None = None) -> bytes:
    body: list[Any] = [time.time() if ts is None else ts, events]
    if rank is not None:
        body.append(rank)
    return pack(body)


def batch_map(events: list[Any], ts: float | None = None, rank: int | None = 0) -> bytes:
    return pack({"ts": time.time() if ts is None else ts, "events": events, "data_parallel_rank": rank})


# --- a hostile, hand-driven vLLM publisher ----------------------------------------------------------------------------


class Publisher:
    """PUB and replay ROUTER sockets on loopback; ``replay_mode`` says how the ROUTER answers."""

    def __init__(self, topic: bytes = TOPIC) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.rep = self.ctx.socket(zmq.ROUTER)
        self.rep.setsockopt(zmq.LINGER, 0)
        self.rep.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.rep.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.buffer: dict[int, bytes] = {}
        self.replay_mode: str | Callable[[Publisher, bytes, int], None] = "new"  # or "old", "silent"
        self.requests: list[int] = []
        self.next_seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes, *, seq: int | None = None, keep: bool = True, send: bool = True) -> int:
        """Publish ``payload`` under ``seq`` (the next one by default); keep it for replay; maybe lose it."""
        if seq is None:
            seq = self.next_seq
        self.next_seq = seq + 1
        if keep:
            self.buffer[seq] = payload
        if send:
            with self._lock:
                self.pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    def raw(self, frames: list[bytes]) -> None:
        with self._lock:
            self.pub.send_multipart(frames)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.rep, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            with self._lock:
                frames = self.rep.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.requests.append(start)
            mode = self.replay_mode
            if callable(mode):
                mode(self, client, start)
                continue
            if mode == "silent":
                continue
            for seq in sorted(self.buffer):
                if seq >= start:
                    head = [client, b""] + ([self.topic] if mode == "new" else [])
                    with self._lock:
                        self.rep.send_multipart([*head, seq_bytes(seq), self.buffer[seq]])
            end = [client, b""] + ([b""] if mode == "new" else [])
            with self._lock:
                self.rep.send_multipart([*end, END_SEQ, b""])

    def reply(self, frames: list[bytes]) -> None:
        with self._lock:
            self.rep.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.rep.close(0)


@contextmanager
def publisher(topic: bytes = TOPIC) -> Iterator[Publisher]:
    pub = Publisher(topic)
    try:
        yield pub
    finally:
        pub.close()


def events_router() -> Router:
    return Router(index=EventIndex(BS, speculative_ttl=0))


@contextmanager
def subscribed(
    pub: Publisher, router: Router | None = None, backend: str = "gpu0", **options: Any
) -> Iterator[tuple[Router, KVEventSubscriber]]:
    """A started subscriber on ``pub`` that has applied at least one of its batches."""
    router = router or events_router()
    options.setdefault("replay_timeout", 0.5)
    options.setdefault("reconnect_backoff", (0.02, 0.2))
    sub = KVEventSubscriber(
        router, backend, pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=pub.topic.decode(), **options
    )
    with sub:
        join(pub, sub)
        yield router, sub
    assert not sub.running


def join(pub: Publisher, sub: KVEventSubscriber) -> None:
    """Publish empty batches until the subscriber has applied the latest (a SUB socket misses what came first)."""
    state = {"at": 0.0, "seq": -1}

    def caught_up() -> bool:
        if state["seq"] >= 0 and sub.last_seq >= state["seq"]:
            return True
        if time.monotonic() - state["at"] > 0.1:
            state["seq"] = pub.publish(batch_array([]))
            state["at"] = time.monotonic()
        return False

    wait_until(caught_up, what="the subscriber to apply the publisher's latest batch")


def applied(sub: KVEventSubscriber, seq: int) -> Callable[[], bool]:
    return lambda: sub.last_seq >= seq


def sound(router: Router, sub: KVEventSubscriber) -> None:
    """What must hold after any input: the index is consistent and the thread lives."""
    router._check()
    assert sub.running


def own(toks: list[int], namespace: str | bytes | None = None) -> set[int]:
    """prefixroute's own hashes of the full blocks of ``toks``, as route() computes them."""
    return set(BlockHasher(BS, namespace=namespace).hash(toks))


# --- events of every vLLM version's layout ----------------------------------------------------------------------------

LAYOUTS: dict[str, tuple[Callable[..., Any], Callable[[list[Any]], Any], Callable[..., bytes]]] = {
    "0.9 array, int hashes, [ts, events]": (stored_v1, removed_array_oldest, lambda ev: batch_array(ev)),
    "0.10 array, medium, rank": (stored_v2, removed_array, lambda ev: batch_array(ev, rank=0)),
    "array with lora_name and group metadata": (stored_v3, removed_array, lambda ev: batch_array(ev, rank=0)),
    "array with trailing fields of a future version": (
        stored_future_array,
        lambda h: [*removed_array(h), 0, "LOCAL", None, "more"],
        lambda ev: batch_array(ev, rank=0),
    ),
    "map events in an array batch": (stored_map, removed_map, lambda ev: batch_array(ev, rank=0)),
    "map events in a map batch": (stored_map, removed_map, lambda ev: batch_map(ev)),
    "map of a future version": (
        stored_map_future,
        lambda h: {**removed_map(h), "group_idx": 0, "locality": "LOCAL", "later": [1]},
        lambda ev: batch_map(ev, rank=None),
    ),
}


@pytest.mark.parametrize("hash_kind", ["int", "bytes"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_vllm_layout_is_applied_and_evicted(layout: str, hash_kind: str) -> None:
    stored, removed, batch = LAYOUTS[layout]

    def h(i: int) -> Any:
        return sha("blk", i) if hash_kind == "bytes" else (2**64 - 1 - i)

    with publisher() as pub, subscribed(pub) as (router, sub):
        chain = tokens(1000, 3)
        seq = pub.publish(batch([stored([h(0), h(1)], None, chain[: 2 * BS]), stored([h(2)], h(1), chain[2 * BS :])]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == own(chain)
        seq = pub.publish(batch([removed([h(2)])]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == own(chain[: 2 * BS])
        seq = pub.publish(
            batch([["AllBlocksCleared"] if isinstance(stored([], None, []), list) else {"type": "AllBlocksCleared"}])
        )
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == set()
        stats = sub.stats()
        assert (stats.invalid_batches, stats.bad_sequences) == (0, 0)
        sound(router, sub)


def lora_stored_map(hashes: list[Any], parent: Any, toks: list[int], extra: Any) -> dict[str, Any]:
    return {**stored_map(hashes, parent, toks), "lora_id": 3, "lora_name": "sql", "extra_keys": extra}


@pytest.mark.parametrize(
    "extra_keys",
    [
        None,
        [["sql"], ["sql"]],  # vLLM before typed keys: one tuple per block, the adapter's name
        [[{"type": "lora", "name": "sql"}], [{"type": "lora", "name": "sql"}]],  # typed ExtraKey structs
    ],
    ids=["no extra keys", "tuple extra keys", "typed lora keys"],
)
def test_a_lora_block_is_indexed_in_its_adapters_namespace_whatever_its_extra_keys_look_like(extra_keys: Any) -> None:
    chain = tokens(5000, 2)
    with publisher() as pub, subscribed(pub) as (router, sub):
        seq = pub.publish(batch_map([lora_stored_map([sha(1), sha(2)], None, chain, extra_keys)]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == own(chain, lora_namespace(None, "sql"))
        sound(router, sub)


@pytest.mark.parametrize(
    "extra_keys",
    [
        [[{"type": "cache_salt", "salt": "s"}], None],
        [[{"type": "mm", "modality": "image", "hash": "abc", "block_offset": 0}], None],
        [[{"type": "prompt_embeds", "hash": b"\x01" * 8}], None],
        [[{"type": "legacy", "value": ["x", 1]}], None],
        [["salt"], None],
        [[{"type": "lora", "name": "other"}], None],
        [[{"type": "lora", "name": "sql", "more": 1}], None],
    ],
    ids=["salt", "mm", "prompt embeds", "legacy", "tuple salt", "another adapter", "a lora key with more"],
)
def test_blocks_named_by_more_than_their_tokens_are_not_indexed(extra_keys: Any) -> None:
    chain = tokens(6000, 2)
    with publisher() as pub, subscribed(pub) as (router, sub):
        seq = pub.publish(batch_map([lora_stored_map([sha(1), sha(2)], None, chain, extra_keys)]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == set()
        sound(router, sub)


def test_a_lora_block_from_a_vllm_that_sends_only_lora_id_is_not_taken_for_a_base_model_block() -> None:
    chain = tokens(7000, 2)
    with publisher() as pub, subscribed(pub) as (router, sub):
        seq = pub.publish(batch_array([["BlockStored", [11, 12], None, chain, BS, 3]]))
        wait_until(applied(sub, seq))
        assert not router.index.hashes("gpu0") & own(chain)
        sound(router, sub)


@pytest.mark.parametrize("medium", ["CPU", "STORAGE", "cpu", "DISK"])
def test_blocks_off_the_gpu_are_not_indexed(medium: str) -> None:
    chain = tokens(8000, 1)
    with publisher() as pub, subscribed(pub) as (router, sub):
        seq = pub.publish(batch_array([["BlockStored", [21], None, chain, BS, None, medium]]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == set()
        sound(router, sub)


# --- sequences: restarts, gaps, replays -------------------------------------------------------------------------------


def stored_batch(start: int, blocks: int = 1, parent: Any = None, first_hash: int = 0) -> bytes:
    toks = tokens(start, blocks)
    return batch_array([stored_v2([first_hash + i for i in range(blocks)], parent, toks)], rank=0)


@pytest.mark.parametrize("mode", ["new", "old"])
def test_a_gap_is_filled_from_the_replay_in_either_framing(mode: str) -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        pub.replay_mode = mode
        base = pub.publish(stored_batch(100, 1, first_hash=1))
        pub.publish(stored_batch(116, 1, parent=1, first_hash=2), send=False)  # lost on the way
        pub.publish(stored_batch(132, 1, parent=2, first_hash=3), send=False)
        last = pub.publish(stored_batch(148, 1, parent=3, first_hash=4))
        wait_until(applied(sub, last))
        assert base + 1 in pub.requests
        assert router.index.hashes("gpu0") == own(tokens(100, 4))
        stats = sub.stats()
        assert (stats.gaps, stats.unrecovered_gaps, stats.failed_replays) == (1, 0, 0)
        sound(router, sub)


def test_a_restart_is_seen_when_the_new_stream_reaches_the_old_streams_last_number() -> None:
    """The new stream's first batches are lost; the one held back is the old stream's last number minus one, and the
    one that continues it repeats the old last number: it is the new stream's, not a repeat."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        old_last = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, old_last))
        pub.buffer.clear()  # a new engine process, its replay buffer empty
        pub.publish(stored_batch(900, 1, first_hash=7), seq=0, send=old_last == 1)
        while pub.next_seq < old_last - 1:
            pub.publish(batch_array([], rank=0), send=False)
        while pub.next_seq <= old_last + 1:  # old_last - 1 (held back), old_last (continues it), old_last + 1
            pub.publish(batch_array([], rank=0))
        wait_until(
            lambda: sub.stats().restarts == 1 and sub.last_seq == pub.next_seq - 1, what="the restart to be acted on"
        )
        assert router.index.hashes("gpu0") == own(tokens(900, 1))
        assert sub.stats().bad_sequences == 0
        sound(router, sub)


def garbage_replies(*frames: list[bytes]) -> Callable[[Publisher, bytes, int], None]:
    def answer(pub: Publisher, client: bytes, start: int) -> None:
        for body in frames:
            pub.reply([client, b"", *body])

    return answer


GARBAGE_REPLAYS: dict[str, list[list[bytes]]] = {
    "not msgpack": [[TOPIC, seq_bytes(1), b"\xc1\xc1\xc1"], [b"", END_SEQ, b""]],
    "seq of 3 bytes": [[TOPIC, b"\x00\x00\x01", b"x"], [b"", END_SEQ, b""]],
    "one frame": [[b"hello"]],
    "six frames": [[b"a", b"b", b"c", b"d"]],
    "an empty frame list after the delimiter": [[]],
    "msgpack of the wrong shape": [[TOPIC, seq_bytes(1), pack({"a": 1})], [b"", END_SEQ, b""]],
    "a seq far in the future": [[TOPIC, seq_bytes(2**62), batch_array([])], [b"", END_SEQ, b""]],
    "a negative seq that is not the end": [[TOPIC, seq_bytes(-7), batch_array([])]],
    "a seq before the one asked for": [[TOPIC, seq_bytes(0), batch_array([])], [b"", END_SEQ, b""]],
    "no end frame": [[TOPIC, seq_bytes(1), batch_array([])]],
}


@pytest.mark.parametrize("garbage", list(GARBAGE_REPLAYS))
def test_a_replay_that_answers_garbage_costs_nothing_but_the_gap(garbage: str) -> None:
    with publisher() as pub, subscribed(pub, replay_timeout=0.3) as (router, sub):
        pub.replay_mode = garbage_replies(*GARBAGE_REPLAYS[garbage])
        first = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, first))
        pub.publish(stored_batch(116, 1, parent=1, first_hash=2), send=False)
        last = pub.publish(stored_batch(132, 1, first_hash=3))
        wait_until(applied(sub, last))
        # live events go on after whatever the replay did
        pub.replay_mode = "new"
        after = pub.publish(stored_batch(148, 1, first_hash=4))
        wait_until(applied(sub, after))
        assert own(tokens(100, 1)) | own(tokens(148, 1)) <= router.index.hashes("gpu0")
        stats = sub.stats()
        assert stats.gaps >= 1
        sound(router, sub)


def test_a_replay_that_never_answers_is_cut_and_live_events_go_on() -> None:
    with publisher() as pub, subscribed(pub, replay_timeout=0.2) as (router, sub):
        pub.replay_mode = "silent"
        first = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, first))
        pub.publish(batch_array([]), send=False)
        last = pub.publish(stored_batch(132, 1, first_hash=3))
        wait_until(applied(sub, last))
        assert sub.stats().failed_replays == 1
        assert own(tokens(132, 1)) <= router.index.hashes("gpu0")
        sound(router, sub)


def test_a_replay_endpoint_that_is_not_a_router_is_survived() -> None:
    with publisher() as pub:
        other = pub.ctx.socket(zmq.PUB)  # nothing answers a DEALER there
        other.setsockopt(zmq.LINGER, 0)
        other.bind("tcp://127.0.0.1:*")
        router = events_router()
        sub = KVEventSubscriber(
            router,
            "gpu0",
            pub.endpoint,
            replay_endpoint=other.getsockopt_string(zmq.LAST_ENDPOINT),
            topic=pub.topic.decode(),
            replay_timeout=0.2,
        )
        try:
            with sub:
                pub.replay_mode = "silent"
                wait_until(lambda: pub.publish(stored_batch(100, 1, first_hash=1)) >= 0 and sub.last_seq >= 0)
                last = pub.publish(stored_batch(300, 1, first_hash=9))
                wait_until(applied(sub, last))
                sound(router, sub)
        finally:
            other.close(0)


# --- hostile live messages --------------------------------------------------------------------------------------------


def test_batches_under_another_topic_are_not_applied() -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        before = sub.stats()
        pub.raw([b"kv@gpu1", seq_bytes(pub.next_seq), stored_batch(100, 1, first_hash=1)])
        pub.raw([b"other", seq_bytes(pub.next_seq), b"\xc1"])
        last = pub.publish(stored_batch(300, 1, first_hash=2))
        wait_until(applied(sub, last))
        assert router.index.hashes("gpu0") == own(tokens(300, 1))
        after = sub.stats()
        assert (after.invalid_batches, after.bad_sequences, after.gaps) == (before.invalid_batches, 0, 0)
        sound(router, sub)


HOSTILE_PAYLOADS = {
    "not msgpack": b"\xc1\xff\x00garbage",
    "empty": b"",
    "a msgpack int": pack(7),
    "a msgpack str": pack("BlockStored"),
    "a batch of two": pack([1.0]),
    "events not a list": pack([1.0, {"x": 1}, 0]),
    "ts a str": pack(["now", [], 0]),
    "a stored event missing fields": pack([1.0, [["BlockStored", [1]]], 0]),
    "a stored event with a str hash": pack([1.0, [["BlockStored", ["h"], None, tokens(0), BS, None]], 0]),
    "a stored event with a nil hash": pack([1.0, [["BlockStored", [None], None, tokens(0), BS, None]], 0]),
    "a stored event with tokens of the wrong count": pack([1.0, [["BlockStored", [1], None, [1, 2], BS, None]], 0]),
    "a stored event with block_size 0": pack([1.0, [["BlockStored", [], None, [], 0, None]], 0]),
    "a stored event with token 2**40": pack([1.0, [["BlockStored", [1], None, [2**40] * BS, BS, None]], 0]),
    "a map event without type": pack({"ts": 1.0, "events": [{"block_hashes": [1]}]}),
    "a map batch without events": pack({"ts": 1.0}),
    "nested deeply": b"\x91" * 100_000 + b"\xc0",
    "a float hash": pack([1.0, [["BlockRemoved", [1.5]]], 0]),
    "truncated": stored_batch(100, 4)[:-5],
    "huge": pack([1.0, [["BlockRemoved", ["x"] * 2_000_000]], 0]),
    "huge garbage": b"\xdb\xff\xff\xff\xff" + b"x" * 1_000_000,
}


@pytest.mark.parametrize("hostile", list(HOSTILE_PAYLOADS))
def test_a_hostile_payload_costs_only_its_batch(hostile: str) -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        first = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, first))
        before = sub.stats().invalid_batches
        bad = pub.publish(HOSTILE_PAYLOADS[hostile])
        wait_until(applied(sub, bad))
        last = pub.publish(stored_batch(116, 1, parent=1, first_hash=2))
        wait_until(applied(sub, last))
        assert router.index.hashes("gpu0") == own(tokens(100, 2))
        stats = sub.stats()
        assert stats.invalid_batches + stats.tracker.invalid_events > before
        assert stats.gaps == 0
        sound(router, sub)


@pytest.mark.parametrize(
    "frames",
    [
        [TOPIC],
        [TOPIC, seq_bytes(1)],
        [TOPIC, b"\x00" * 7, b"x"],
        [TOPIC, b"\x00" * 9, b"x"],
        [TOPIC, seq_bytes(1), b"x", b"y"],
        [TOPIC, b"", b""],
    ],
    ids=["one frame", "two frames", "seq of 7 bytes", "seq of 9 bytes", "four frames", "empty frames"],
)
def test_a_message_of_the_wrong_shape_is_counted_and_skipped(frames: list[bytes]) -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        before = sub.stats().invalid_batches
        pub.raw(frames)
        last = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, last))
        assert router.index.hashes("gpu0") == own(tokens(100, 1))
        assert sub.stats().invalid_batches == before + 1
        sound(router, sub)


@pytest.mark.parametrize("ts", [math.nan, math.inf, -math.inf, 1e300, -1e300, 0.0, -1.0, 2.0**70])
def test_an_absurd_timestamp_still_applies_its_events_and_gives_no_absurd_lag(ts: float) -> None:
    seen: list[float] = []
    with publisher() as pub, subscribed(pub, lag_observer=seen.append) as (router, sub):
        seq = pub.publish(batch_array([stored_v2([1], None, tokens(100))], ts=ts, rank=0))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == own(tokens(100))
        lag = sub.stats().last_lag_s
        assert lag is None or math.isfinite(lag)
        assert all(math.isfinite(x) for x in seen)
        assert sub.stats().observer_errors == 0
        sound(router, sub)


@pytest.mark.parametrize("seq", [2**63 - 1, 2**62, -1, -(2**63), 10**6])
def test_one_absurd_sequence_number_costs_one_batch_not_the_index(seq: int) -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        first = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, first))
        pub.raw([TOPIC, seq_bytes(seq), stored_batch(500, 1, first_hash=5)])
        last = pub.publish(stored_batch(116, 1, parent=1, first_hash=2))
        wait_until(applied(sub, last))
        nxt = pub.publish(stored_batch(132, 1, parent=2, first_hash=3))
        wait_until(applied(sub, nxt))
        assert router.index.hashes("gpu0") == own(tokens(100, 3))
        stats = sub.stats()
        assert stats.bad_sequences == 1
        assert (stats.restarts, stats.gaps) == (0, 0)
        sound(router, sub)


def test_signed_hashes_of_vllm_s_builtin_hash_are_applied_and_evicted() -> None:
    """vLLM 0.9's default ``builtin`` prefix-caching hash is Python's hash(): a signed 64-bit int."""
    with publisher() as pub, subscribed(pub) as (router, sub):
        chain = tokens(100, 2)
        seq = pub.publish(batch_array([stored_v1([-(2**63), -1], None, chain)]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == own(chain)
        seq = pub.publish(batch_array([removed_array_oldest([-1])]))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == own(chain[:BS])
        assert sub.stats().invalid_batches == 0
        sound(router, sub)


def test_a_huge_valid_batch_is_applied() -> None:
    with publisher() as pub, subscribed(pub) as (router, sub):
        n = 20_000
        chain = list(range(n * BS))
        seq = pub.publish(batch_array([stored_v2(list(range(1, n + 1)), None, chain)], rank=0))
        wait_until(applied(sub, seq))
        assert len(router.index.hashes("gpu0")) == n
        seq = pub.publish(batch_array([removed_array(list(range(1, n + 1)))], rank=0))
        wait_until(applied(sub, seq))
        assert router.index.hashes("gpu0") == set()
        sound(router, sub)


# --- /metrics of several vLLM versions --------------------------------------------------------------------------------

V0_TEXT = """\
# HELP vllm:cache_config_info information of cache_config
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",cpu_offload_gb="0",enable_prefix_caching="True",\
gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="8192",num_gpu_blocks_override="None",\
sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.5
"""

V1_DP_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="my \\"quoted\\" model, {a}"} 1.0
vllm:num_requests_running{engine="1",model_name="my \\"quoted\\" model, {a}"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="my \\"quoted\\" model, {a}"} 4.0
vllm:num_requests_waiting{engine="1",model_name="my \\"quoted\\" model, {a}"} 6.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="my \\"quoted\\" model, {a}"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="my \\"quoted\\" model, {a}"} 0.4
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="my \\"quoted\\" model, {a}"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="my \\"quoted\\" model, {a}"} 3000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="my \\"quoted\\" model, {a}"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="my \\"quoted\\" model, {a}"} 500.0
vllm:prefix_cache_hits_total{engine="1",model_name="my \\"quoted\\" model, {a}"} 1500.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="1000",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256"} 1.0
"""


def test_metrics_of_vllm_v0_are_read() -> None:
    m = parse_metrics(V0_TEXT)
    assert (m.running, m.waiting, m.kv_usage) == (3, 2, 0.25)
    assert (m.block_size, m.num_gpu_blocks) == (16, 8192)
    assert m.ttft_count == 10


def test_metrics_of_a_data_parallel_v1_server_are_summed_with_escaped_labels() -> None:
    m = parse_metrics(V1_DP_TEXT)
    assert (m.running, m.waiting) == (3, 10)
    assert m.kv_usage == pytest.approx(0.3)
    assert (m.prefix_queries, m.prefix_hits) == (4000, 2000)
    # each engine's series carries the server's total: vLLM sums its engines' blocks into one cache config
    assert (m.block_size, m.num_gpu_blocks) == (16, 1000)


def test_openmetrics_counters_without_the_total_suffix_in_their_type_line_are_read() -> None:
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0"} 10.0\n'
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0"} 4.0\n'
        "# EOF\n"
    )
    m = parse_metrics(text)
    assert (m.prefix_queries, m.prefix_hits) == (10, 4)


@pytest.mark.parametrize(
    "text",
    [
        "vllm:num_requests_waiting NaN\n",
        "vllm:num_requests_waiting +Inf\n",
        "vllm:kv_cache_usage_perc -Inf\n",
        'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_waiting{engine="1"} 1.7e308\n'
        'vllm:num_requests_waiting{engine="2"} 1.7e308\n',
        'vllm:num_requests_waiting{engine="0',
        'vllm:num_requests_waiting{engine="0"',
        'vllm:num_requests_waiting{engine="0"} ',
        "num_requests_waiting 3\nnum_requests_running 1\n",
        '<html><body>{"detail":"Not Found"}</body></html>',
        '{"detail":"Not Found"}',
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e400"} 1.0\n',
        'vllm:cache_config_info{block_size="sixteen",num_gpu_blocks="10"} 1.0\n',
        "",
        "\x00\x01\x02",
    ],
)
def test_unreadable_or_nonsense_metrics_are_metrics_errors(text: str) -> None:
    with pytest.raises(MetricsError):
        parse_metrics(text)


def test_unset_cache_config_figures_of_a_starting_engine_are_unknown() -> None:
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\nvllm:num_requests_waiting 0\n'
    m = parse_metrics(text)
    assert m.num_gpu_blocks is None


# --- a fake engine's HTTP side: any answer to any path ----------------------------------------------------------------

Route = tuple[int, dict[str, str], bytes]


@contextmanager
def http_engine(routes: dict[str, Route | Callable[[BaseHTTPRequestHandler], None]]) -> Iterator[str]:
    """An HTTP server on loopback answering each path from ``routes`` (404 otherwise); yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            route = routes.get(self.path.split("?")[0])
            try:
                if callable(route):
                    route(self)
                    return
                status, headers, body = route if route is not None else (404, {}, b'{"detail":"Not Found"}')
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client went away
                pass

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            """Quiet: a client that resets the connection while the handler waits for its next request (doctor
            closing after a 502) is no fault, and the traceback socketserver prints would land in the output the
            doctor tests read (stderr is redirected for the whole process)."""

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def ok(text: str | bytes, **headers: str) -> Route:
    return (
        200,
        {"Content-Type": "text/plain; version=0.0.4; charset=utf-8", **headers},
        (text.encode() if isinstance(text, str) else text),
    )


def trickle(body: bytes, pause: float = 0.05) -> Callable[[BaseHTTPRequestHandler], None]:
    def serve(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        for i in range(len(body)):
            handler.wfile.write(body[i : i + 1])
            handler.wfile.flush()
            time.sleep(pause)

    return serve


def test_fetch_reads_every_version_and_follows_what_a_real_vllm_serves() -> None:
    with http_engine({"/metrics": ok(V1_DP_TEXT)}) as url:
        assert fetch_metrics(url + "/metrics", timeout=2).waiting == 10


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_to_the_metrics_is_followed(status: int) -> None:
    """Older vLLM mounted prometheus' ASGI app at /metrics, which answers /metrics with a 307 to /metrics/."""
    with http_engine({"/metrics": (status, {"Location": "/metrics/"}, b""), "/metrics/": ok(V0_TEXT)}) as url:
        assert fetch_metrics(url + "/metrics", timeout=2).waiting == 2


@pytest.mark.parametrize(
    "route",
    [
        (500, {}, b"Internal Server Error"),
        (503, {"Retry-After": "1"}, b""),
        (200, {"Content-Type": "text/plain"}, b"\xff\xfe\xfavllm:num_requests_waiting 1\n\xc3\x28"),
        (200, {"Content-Type": "text/html"}, b"<html><title>nginx</title></html>"),
        (301, {"Location": "/elsewhere"}, b""),
        (302, {"Location": "/metrics"}, b""),  # a loop
    ],
    ids=["500", "503", "not utf-8", "not vllm", "redirect to a 404", "redirect loop"],
)
def test_a_bad_answer_is_a_metrics_error(route: Route) -> None:
    with http_engine({"/metrics": route}) as url, pytest.raises(MetricsError):
        fetch_metrics(url + "/metrics", timeout=2)


def test_a_50_mb_body_and_a_trickling_server_are_metrics_errors() -> None:
    big = b"vllm:num_requests_waiting 1\n" + b"# padding " + b"x" * (50 * 2**20) + b"\n"
    slow = trickle(V0_TEXT.encode())
    hop: Route = (307, {"Location": "/slow/metrics"}, b"")
    with http_engine({"/metrics": ok(big), "/slow/metrics": slow, "/hop/metrics": hop}) as url:
        with pytest.raises(MetricsError):
            fetch_metrics(url + "/metrics", timeout=3)
        for path in ("/slow/metrics", "/hop/metrics"):
            with pytest.raises(MetricsError, match="no complete answer"):
                fetch_metrics(url + path, timeout=0.3)


# --- doctor against fake engines --------------------------------------------------------------------------------------


def doctor_run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(["doctor", "--timeout", "2", *args])
    return status, out.getvalue(), err.getvalue()


def test_doctor_reads_engines_of_every_version_and_judges_each() -> None:
    with http_engine({"/metrics": ok(V1_DP_TEXT), "/old/metrics": ok(V0_TEXT)}) as url:
        status, out, _ = doctor_run(url, url + "/old", "--json")
    report = json.loads(out)
    assert status == report["exit_code"] == 1
    assert [t["verdict"] for t in report["targets"]] == ["healthy", "suspect"]  # v0's P99 is past its last bucket
    assert report["targets"][0]["prefix_hit_rate"] == pytest.approx(0.5)


def test_doctor_reads_no_engine_through_a_port_past_65535() -> None:
    # Was HEALTHY, exit 0: httpx took the port and connected to it modulo 65536, here an engine's that answers.
    with http_engine({"/metrics": ok(V1_DP_TEXT)}) as url:
        port = int(url.rsplit(":", 1)[1])
        assert doctor_run(url)[0] == 0  # the engine is there, on its own port
        status, out, err = doctor_run(f"http://127.0.0.1:{port + 65536}")
    assert status == 2 and out.splitlines()[0].endswith(": UNREADABLE"), out + err
    assert "Port out of range 0-65535" in out + err


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:{closed}",
        "http://[::1",
        "http://127.0.0.1:99999",
        "http://",  # (another scheme, ftp://, is a bad option: tests/test_cli_files.py)
        "{url}/not-vllm",
        "{url}/broken",
        "{url}/nan",
        "{url}/cut",
    ],
)
def test_doctor_answers_what_it_cannot_read_with_exit_2_and_a_one_line_reason(
    target: str, refused_port: Callable[[], int]
) -> None:
    routes: dict[str, Route | Callable[[BaseHTTPRequestHandler], None]] = {
        "/not-vllm/metrics": ok("<!doctype html><title>Welcome to nginx!</title>"),
        "/broken/metrics": (502, {}, b"Bad Gateway"),
        "/nan/metrics": ok("vllm:num_requests_waiting NaN\n"),
        "/cut/metrics": ok(V1_DP_TEXT[: V1_DP_TEXT.index('model_name="my') + 8]),
    }
    with http_engine(routes) as url:
        status, out, err = doctor_run(target.format(closed=refused_port(), url=url))
    assert status == 2
    assert "Traceback" not in out + err
    verdict, *reasons = [line for line in (out + err).splitlines() if line.strip()]
    assert verdict.endswith(": UNREADABLE") and len(reasons) == 1, (verdict, reasons)


# --- a fleet whose backends come and go while events flow -------------------------------------------------------------


class Flow:
    """Publishes a growing chain on ``pub`` from a thread of its own until stopped."""

    def __init__(self, pub: Publisher, base: int) -> None:
        self.pub, self.base, self.blocks = pub, base, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set() and self.blocks < 400:
            parent = self.base + self.blocks - 1 if self.blocks else None
            toks = tokens(self.base * BS + self.blocks * BS)
            self.pub.publish(batch_array([stored_v2([self.base + self.blocks], parent, toks)], rank=0))
            self.blocks += 1
            time.sleep(0.002)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_backends_added_and_removed_while_events_flow_leave_the_others_exact() -> None:
    router = events_router()
    with publisher() as a, publisher() as b, publisher() as c, Fleet(router) as fleet:
        for name, pub in (("a", a), ("b", b)):
            fleet.add_backend(name, kv_events=pub.endpoint, replay=pub.replay_endpoint, topic=TOPIC.decode())
        flows = [Flow(a, 10_000), Flow(b, 20_000), Flow(c, 30_000)]
        wait_until(lambda: len(router.index.hashes("a")) > 20 and len(router.index.hashes("b")) > 20)
        fleet.remove_backend("a")
        fleet.add_backend("c", kv_events=c.endpoint, replay=c.replay_endpoint, topic=TOPIC.decode())
        router._check()
        for flow in flows:
            flow.end()
        assert router.index.hashes("a") == set()
        assert "a" not in fleet.backends()
        # b and c: exactly what their engines published, once a last batch shows the subscriber caught up
        for name, pub, flow in (("b", b, flows[1]), ("c", c, flows[2])):
            sub = fleet.subscriber(name)
            assert sub is not None
            join(pub, sub)
            blocks = flow.blocks
            want = own(tokens(flow.base * BS, blocks))
            assert router.index.hashes(name) == want, name
            assert sub.stats().invalid_batches == 0 and sub.running
        router._check()
        assert router.index.hashes("a") == set()


def test_a_backend_removed_during_a_replay_fetch_stops_and_writes_nothing_after() -> None:
    router = events_router()
    with publisher() as pub, publisher() as other, Fleet(router) as fleet:
        fleet.add_backend("gpu0", kv_events=pub.endpoint, replay=pub.replay_endpoint, topic=TOPIC.decode())
        fleet.add_backend("gpu1", kv_events=other.endpoint, replay=other.replay_endpoint, topic=TOPIC.decode())
        sub = fleet.subscriber("gpu0")
        assert sub is not None
        join(pub, sub)
        pub.replay_mode = "silent"
        first = pub.publish(stored_batch(100, 1, first_hash=1))
        wait_until(applied(sub, first))
        pub.publish(stored_batch(116, 1, parent=1, first_hash=2), send=False)
        asked = len(pub.requests)
        pub.publish(stored_batch(132, 1, parent=2, first_hash=3))
        wait_until(lambda: len(pub.requests) > asked, what="the replay request")
        fleet.remove_backend("gpu0")  # while the subscriber waits for a replay that never comes
        assert not sub.running
        assert router.index.hashes("gpu0") == set()
        other_sub = fleet.subscriber("gpu1")
        assert other_sub is not None
        join(other, other_sub)
        seq = other.publish(stored_batch(500, 1, first_hash=5))
        wait_until(applied(other_sub, seq))
        assert router.index.hashes("gpu1") == own(tokens(500, 1))
        pub.replay_mode = "new"
        pub.publish(stored_batch(148, 1, first_hash=4))
        time.sleep(0.05)
        assert router.index.hashes("gpu0") == set()
        router._check()
