"""prefixroute: route LLM requests to the backend that already holds their prompt prefix in its KV cache.

>>> from prefixroute import Router
>>> router = Router()
>>> decision = router.route(list(range(64)), ["http://gpu0:8000", "http://gpu1:8000"])
>>> decision.reason
'miss'
"""

from __future__ import annotations

from prefixroute.errors import (
    ConfigurationError,
    DecisionError,
    InvalidEventError,
    InvalidPromptError,
    InvalidTraceError,
    InvalidTypeError,
    MetricsError,
    NoBackendError,
    PolicyError,
    PrefixRouteError,
    StateError,
)
from prefixroute.hashing import BlockHash, BlockHasher, encode_tokens
from prefixroute.index import PrefixIndex
from prefixroute.policies import (
    BoundedLoad,
    Candidate,
    CostAware,
    LeastLoaded,
    LinearTTFT,
    LoadPolicy,
    PowerOfTwo,
    PredictedTTFT,
    PrefixAffinity,
    Random,
    RoundRobin,
    kv_fraction,
    policy_from_name,
    policy_names,
)
from prefixroute.router import Decision, Reason, Router, RouterStats

__version__ = "0.1.0"

__all__ = [
    "BlockHash",
    "BlockHasher",
    "BoundedLoad",
    "Candidate",
    "ConfigurationError",
    "CostAware",
    "Decision",
    "DecisionError",
    "InvalidEventError",
    "InvalidPromptError",
    "InvalidTraceError",
    "InvalidTypeError",
    "LeastLoaded",
    "LinearTTFT",
    "LoadPolicy",
    "MetricsError",
    "NoBackendError",
    "PolicyError",
    "PowerOfTwo",
    "PredictedTTFT",
    "PrefixAffinity",
    "PrefixIndex",
    "PrefixRouteError",
    "Random",
    "Reason",
    "RoundRobin",
    "Router",
    "RouterStats",
    "StateError",
    "__version__",
    "encode_tokens",
    "kv_fraction",
    "policy_from_name",
    "policy_names",
]
