"""The KV events of one vLLM server's data-parallel ranks, merged into one backend's index.

A server run with ``--data-parallel-size N`` behind one API server has N engines, each with its own prefix cache,
publishing its own event stream on its own endpoint (vLLM offsets the configured port by the rank:
:func:`rank_endpoint`). The router sees one backend: it holds a block while *any* rank holds it. One subscriber per
rank, each writing the backend's index directly, would undo each other: rank 0 evicting a block would remove it
although rank 1 still holds it. :class:`RankMerge` sits between the ranks' subscribers and the index and counts the
ranks holding each block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.index import IndexUpdate, check_update
from prefixroute.vllm._checks import MAX_DATA_PARALLEL_SIZE, check_backend, check_endpoint
from prefixroute.vllm.tracker import IndexOps, IndexWriter, check_writer

__all__ = ["RankMerge", "rank_endpoint"]


class RankMerge:
    """An :class:`~prefixroute.vllm.IndexWriter` that the subscribers of one backend's data-parallel ranks share:
    the backend's index holds a block while at least one rank holds it.

    Each rank's subscriber (its :class:`~prefixroute.vllm.BlockTracker`) writes a block's store once, when that rank
    starts holding it, and its removal once, when the rank stops (an eviction, the rank's ``AllBlocksCleared``, its
    restart or :meth:`KVEventSubscriber.reset`). So counting stores and removals per (backend, block) counts the
    ranks holding it: a store passes through (the chain's parent is held by the storing rank, hence in the index, so
    the index stays prefix-closed as it is with one stream); a removal reaches ``writer`` only for the blocks no rank
    holds any more. A removal of a block never stored here passes through (the index cannot hold it for a rank).

    Thread-safe: the count and the write to ``writer`` happen under one lock, so ``writer`` sees every block's stores
    and removals in the order the counts changed. O(hashes) per write, plus ``writer``'s time; one int per block
    held (by any rank).

    >>> from prefixroute import Router
    >>> router = Router(block_size=16)
    >>> merge = RankMerge(router)
    >>> merge.write("gpu0", [(True, [11, 12], None)])   # rank 0 stores blocks 11, 12
    >>> merge.write("gpu0", [(True, [11], None)])       # rank 1 stores block 11
    >>> merge.write("gpu0", [(False, [11, 12], None)])  # rank 0 evicts both: rank 1 still holds 11
    >>> sorted(router.index.hashes("gpu0")), merge.holders("gpu0", 11)
    ([11], 1)

    Raises:
        TypeError: ``writer`` has no ``write`` method or no int ``block_size``.
    """

    def __init__(self, writer: IndexWriter) -> None:
        check_writer(writer)
        self._writer = writer
        # Reentrant: a writer may make another rank's subscriber write from inside this write (its reset() writes
        # that rank's removals here); the counts are whole before ``writer`` is called, so the inner write sees them.
        self._lock = threading.RLock()
        self._holders: dict[str, dict[int, int]] = {}  # backend -> block hash -> ranks holding it

    @property
    def block_size(self) -> int:
        """The block size of ``writer`` (what the subscribers hash with)."""
        return self._writer.block_size

    def write(self, backend: str, updates: Iterable[IndexUpdate]) -> None:
        """Count ``updates`` (one rank's, in order) and write ``writer`` what changes the merged index.

        Stores pass through; each removal keeps only the blocks that no rank holds any more (an update left with
        no block is dropped). An exception from ``writer`` propagates after the counts changed: the counts follow
        the ranks (as the subscribers' trackers do), not what reached the index.

        Raises:
            TypeError: ``backend`` is not a str, or an update is not a ``(stored, hashes, parent)`` tuple
                (nothing counted).
            InvalidEventError: a hash or parent is not an int in [0, 2**64) (nothing counted).
            ConfigurationError: ``backend`` is an empty str (nothing counted).
        """
        backend = check_backend(backend)
        if isinstance(updates, (str, bytes)) or not isinstance(updates, Iterable):
            raise InvalidTypeError(f"updates must be an iterable of index updates, not {type(updates).__name__}")
        # Checked whole before anything is counted: a count the writer never sees would keep a block for good.
        updates = [check_update(update) for update in updates]
        with self._lock:
            holders = self._holders.setdefault(backend, {})
            merged: IndexOps = []
            for stored, hashes, parent in updates:
                if stored:
                    for h in hashes:
                        holders[h] = holders.get(h, 0) + 1
                    merged.append((True, hashes, parent))
                    continue
                dead: list[int] = []
                for h in hashes:
                    held = holders.get(h, 0) - 1
                    if held > 0:
                        holders[h] = held
                    else:
                        holders.pop(h, None)
                        dead.append(h)
                if dead:
                    merged.append((False, dead, None))
            if not holders:
                del self._holders[backend]
            if merged:
                self._writer.write(backend, merged)

    def holders(self, backend: str, block_hash: int) -> int:
        """How many ranks hold ``block_hash`` for ``backend``, as their subscribers wrote. O(1).

        Raises:
            TypeError: ``backend`` is not a str or ``block_hash`` not an int.
            ConfigurationError: ``backend`` is an empty str.
        """
        backend = check_backend(backend)
        block = as_int(block_hash)
        if block is None:
            raise InvalidTypeError(f"block_hash must be an int, not {type(block_hash).__name__}")
        with self._lock:
            return self._holders.get(backend, {}).get(block, 0)

    def blocks(self, backend: str) -> int:
        """How many distinct blocks at least one rank of ``backend`` holds. O(1).

        Raises:
            TypeError: ``backend`` is not a str.
            ConfigurationError: ``backend`` is an empty str.
        """
        backend = check_backend(backend)
        with self._lock:
            return len(self._holders.get(backend, ()))

    def __repr__(self) -> str:
        with self._lock:
            counts = {backend: len(held) for backend, held in self._holders.items()}
        return f"RankMerge(blocks={counts!r})"


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` publishes on when the server is configured with ``endpoint``.

    As vLLM's ``ZmqEventPublisher.offset_endpoint_port``: rank 0 keeps ``endpoint``; a ``tcp://`` port grows by
    the rank, an ``inproc://`` name gets ``_dp<rank>`` appended. vLLM does not offset ``ipc://`` addresses (it
    refuses them with data parallelism): list each rank's endpoint yourself then.

    >>> rank_endpoint("tcp://gpu0:5557", 0), rank_endpoint("tcp://gpu0:5557", 3), rank_endpoint("inproc://kv", 1)
    ('tcp://gpu0:5557', 'tcp://gpu0:5560', 'inproc://kv_dp1')

    Raises:
        ConfigurationError: ``endpoint`` is not a ZMQ address to connect to, is an ``ipc://`` one (for a rank
            above 0), or its port plus ``rank`` is past 65535; ``rank`` is not an int in [0, 1023] (a rank of at
            most :data:`~prefixroute.vllm._checks.MAX_DATA_PARALLEL_SIZE` ranks).
    """
    check_endpoint(endpoint, "endpoint", "tcp://gpu0:5557")
    number = as_int(rank)
    if number is None or not 0 <= number < MAX_DATA_PARALLEL_SIZE:
        raise ConfigurationError(
            f"rank must be an int in [0, {MAX_DATA_PARALLEL_SIZE - 1}] (a data-parallel rank), not {shown(rank)}"
        )
    rank = number
    if rank == 0:
        return endpoint
    scheme, _, address = endpoint.partition("://")
    if scheme == "inproc":
        return f"{endpoint}_dp{rank}"
    if scheme != "tcp":
        raise ConfigurationError(
            f"vLLM does not offset {endpoint!r} for data-parallel rank {rank} (only tcp:// ports and inproc:// names): "
            "pass each rank's endpoint in a list instead of data_parallel_size"
        )
    host, _, port = address.rpartition(":")
    if int(port) + rank > 65535:
        raise ConfigurationError(
            f"{endpoint!r} offset by data-parallel rank {shown(rank)} is past port 65535: configure vLLM with a "
            "lower port"
        )
    return f"tcp://{host}:{int(port) + rank}"
