"""vLLM integration: exact prefix index from KV-cache events, engine load from ``/metrics``, ``prefixroute doctor``.

Needs the ``prefixroute[vllm]`` extra (pyzmq, msgspec, httpx, prometheus-client).
"""

from __future__ import annotations

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
from prefixroute.vllm.tracker import BlockTracker, TrackerStats, apply_ops, lora_namespace

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "BlockTracker",
    "EventBatch",
    "EventDecoder",
    "KVCacheEvent",
    "KVEventSubscriber",
    "SubscriberStats",
    "TrackerStats",
    "apply_ops",
    "encode_batch",
    "lora_namespace",
]
