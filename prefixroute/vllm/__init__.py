"""vLLM integration: a :class:`Fleet` that drives a router from KV-cache events and ``/metrics``, the
:class:`EventIndex` those events write, and ``prefixroute doctor``.

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
from prefixroute.vllm.fleet import BackendStats, Fleet, FleetStats
from prefixroute.vllm.index import EventIndex
from prefixroute.vllm.metrics import EngineMetrics, fetch_metrics, parse_metrics
from prefixroute.vllm.ranks import RankMerge, rank_endpoint
from prefixroute.vllm.subscriber import KVEventSubscriber, SubscriberStats
from prefixroute.vllm.tracker import BlockTracker, IndexWriter, TrackerStats, lora_namespace

__all__ = [
    "AllBlocksCleared",
    "BackendStats",
    "BlockRemoved",
    "BlockStored",
    "BlockTracker",
    "EngineMetrics",
    "EventBatch",
    "EventDecoder",
    "EventIndex",
    "Fleet",
    "FleetStats",
    "IndexWriter",
    "KVCacheEvent",
    "KVEventSubscriber",
    "RankMerge",
    "SubscriberStats",
    "TrackerStats",
    "encode_batch",
    "fetch_metrics",
    "lora_namespace",
    "parse_metrics",
    "rank_endpoint",
]
