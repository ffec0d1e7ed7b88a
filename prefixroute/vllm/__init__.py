"""vLLM integration: exact prefix index from KV-cache events, engine load from ``/metrics``, ``prefixroute doctor``.

Needs the ``prefixroute[vllm]`` extra (pyzmq, msgspec, httpx, prometheus-client).
"""

from __future__ import annotations

try:
    import httpx  # noqa: F401
    import msgspec  # noqa: F401
    import prometheus_client  # noqa: F401
    import zmq  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is installed wherever tests run
    raise ImportError(
        f"prefixroute.vllm needs the 'vllm' extra ({exc.name} is missing): pip install 'prefixroute[vllm]'"
    ) from exc

from prefixroute.vllm.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecoder,
    KVCacheEvent,
    encode_batch,
)
from prefixroute.vllm.subscriber import KVEventSubscriber, SubscriberStats
from prefixroute.vllm.tracker import BlockTracker, IndexWriter, TrackerStats, apply_ops, lora_namespace

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockTracker",
    "EventBatch",
    "EventDecoder",
    "IndexWriter",
    "KVCacheEvent",
    "KVEventSubscriber",
    "SubscriberStats",
    "TrackerStats",
    "apply_ops",
    "encode_batch",
    "lora_namespace",
]
