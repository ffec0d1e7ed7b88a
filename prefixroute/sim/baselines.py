"""Published routers' policies, re-implemented as reference baselines for the simulator (not core defaults).

Each class re-implements one open-source router's decision rule from its public source (named in its docstring with
the constants it took), on the information a :class:`~prefixroute.Candidate` carries. They are written from the
sources' logic, not copied. What every one of them keeps in its own index (a radix tree of request text, a hash
table of blocks) is the router's :class:`~prefixroute.PrefixIndex` here, so ``matched_tokens`` stands for their
match; where a rule needs a figure the candidate lacks, the docstring says what stands in for it. Randomised rules
take ``seed`` or ``rng`` (the simulator seeds them from ``--seed``); where the source breaks a tie at random or by
hash-map order, these break it by placement order, so runs are reproducible.

Select them by name (:data:`BASELINES`) or by path, e.g.
``prefixroute simulate --policy prefixroute.sim.baselines:SGLangCacheAware``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from prefixroute.errors import ConfigurationError
from prefixroute.policies import Candidate, LoadPolicy

__all__ = [
    "BASELINES",
    "AIBrixPrefixCache",
    "DynamoKvRouter",
    "LlmdDefaultProfile",
    "ProductionStackPrefixAware",
    "RayServePrefixAware",
    "SGLangCacheAware",
]


class _TreeSizes:
    """Tokens a router has inserted per backend: the size of a per-backend prefix tree that never evicts.

    SGLang's, Ray Serve's and Dynamo's routers prefer the backend whose tree is smallest when nothing matches
    well; a routed request adds the part of its prompt the chosen backend's tree lacks, its uncached tokens.
    """

    __slots__ = ("_sizes",)

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def size(self, candidate: Candidate) -> int:
        return self._sizes.get(candidate.backend, 0)

    def smallest(self, candidates: Sequence[Candidate]) -> Candidate:
        return min(candidates, key=self.size)

    def record(self, chosen: Candidate) -> Candidate:
        self._sizes[chosen.backend] = self._sizes.get(chosen.backend, 0) + chosen.uncached_tokens
        return chosen


def _rng(seed: int | None, rng: random.Random | None) -> random.Random:
    if rng is not None and not isinstance(rng, random.Random):
        raise ConfigurationError(f"rng must be a random.Random, not {type(rng).__name__}")
    return rng if rng is not None else random.Random(seed)


def _match_rate(candidate: Candidate) -> float:
    return candidate.matched_tokens / candidate.prompt_tokens if candidate.prompt_tokens else 0.0


class SGLangCacheAware(LoadPolicy):
    """SGLang router's ``cache_aware`` policy: shortest queue when imbalanced, else the best prefix match.

    Source: ``sgl-project/sglang``, ``sgl-router/src/policies/cache_aware.rs`` (``CacheAwarePolicy.select_worker``);
    defaults from the router's CLI (``--cache-threshold 0.3 --balance-abs-threshold 64
    --balance-rel-threshold 1.5``). Loads are the router's pending requests per worker (``in_flight``). The system
    is imbalanced when ``max - min > balance_abs_threshold`` **and** ``max > min × balance_rel_threshold``: then the
    least loaded worker. Otherwise the worker with the longest match if its match rate (matched / prompt) is above
    ``cache_threshold``, else the worker with the smallest tree (the tokens routed to it, :class:`_TreeSizes`).
    SGLang matches characters of the request text; this matches the router's blocks. O(len(candidates)).
    """

    name = "sglang"
    prefix_aware = True

    def __init__(
        self, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._trees = _TreeSizes()

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        loads = [c.in_flight for c in candidates]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return self._trees.record(min(candidates, key=lambda c: c.in_flight))
        best = max(candidates, key=lambda c: c.matched_tokens)
        if _match_rate(best) > self.cache_threshold:
            return self._trees.record(best)
        return self._trees.record(self._trees.smallest(candidates))

    def __repr__(self) -> str:
        return (
            f"SGLangCacheAware(cache_threshold={self.cache_threshold}, balance_abs_threshold="
            f"{self.balance_abs_threshold}, balance_rel_threshold={self.balance_rel_threshold})"
        )


class DynamoKvRouter(LoadPolicy):
    """NVIDIA Dynamo's KV router cost: ``overlap_score_weight × prefill_blocks + decode_blocks``, lowest wins.

    Source: ``ai-dynamo/dynamo``, ``lib/llm/src/kv_router/scheduler.rs`` (``DefaultWorkerSelector.select_worker``
    and ``softmax_sample``); defaults ``overlap_score_weight = 1.0`` and ``router_temperature = 0.0``. Per worker,
    ``prefill_blocks`` is the prefill tokens it would have with this request (its active prefill tokens plus this
    request's uncached tokens) over the block size, and ``decode_blocks`` the KV blocks of its active requests plus
    this request's new blocks. Dynamo tracks both router-side; here they come from the router's accounting
    (``pending_prefill_tokens``, ``held_blocks``), and ``block_size`` is the router's (16 by default). At
    temperature 0 the lowest logit wins, ties to the smallest tree (tokens routed there), then placement order;
    above 0, logits are min-max normalised and sampled by ``softmax(-normalised / temperature)`` from ``rng``.
    O(len(candidates)).
    """

    name = "dynamo"
    prefix_aware = True

    def __init__(
        self,
        *,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        block_size: int = 16,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if temperature < 0 or block_size < 1:
            raise ConfigurationError("temperature must be >= 0 and block_size >= 1")
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.block_size = block_size
        self._rng = _rng(seed, rng)
        self._trees = _TreeSizes()

    def logit(self, candidate: Candidate) -> float:
        """The worker's cost for this request (lower is better). O(1)."""
        size = self.block_size
        prefill_blocks = (candidate.pending_prefill_tokens + candidate.uncached_tokens) / size
        request_blocks = -(-candidate.prompt_tokens // size)
        new_blocks = request_blocks - candidate.matched_tokens // size
        return self.overlap_score_weight * prefill_blocks + candidate.held_blocks + new_blocks

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        logits = [self.logit(c) for c in candidates]
        if self.temperature == 0.0:
            lowest = min(logits)
            tied = [c for c, value in zip(candidates, logits, strict=True) if value == lowest]
            return self._trees.record(self._trees.smallest(tied))
        low, high = min(logits), max(logits)
        if high == low:
            weights = [1.0] * len(candidates)
        else:
            weights = [math.exp(-(value - low) / (high - low) / self.temperature) for value in logits]
        return self._trees.record(self._rng.choices(candidates, weights=weights)[0])

    def __repr__(self) -> str:
        return f"DynamoKvRouter(overlap_score_weight={self.overlap_score_weight}, temperature={self.temperature})"


class LlmdDefaultProfile(LoadPolicy):
    """llm-d's default scheduling profile: prefix-cache (weight 3) + queue (2) + KV-utilisation (2) scorers.

    Source: ``llm-d/llm-d-inference-scheduler`` default ``EndpointPickerConfig`` (``prefix-cache-scorer`` 3,
    ``queue-scorer`` 2, ``kv-cache-utilization-scorer`` 2, ``max-score-picker``) and the scorers of
    ``kubernetes-sigs/gateway-api-inference-extension`` ``pkg/epp/scheduling/framework/plugins/scorer/``: prefix =
    matched blocks / the request's blocks (here matched / prompt tokens); queue = ``(max - q) / (max - min)`` over
    the endpoints, 1 for all when equal; KV = ``1 - kv_usage``. The highest weighted sum wins (ties: placement
    order, where the picker shuffles). The queue is the engine's ``queue_len`` when metrics supply it, else the
    router's ``in_flight``; KV use is the engine's ``kv_usage``, else ``held_blocks / capacity_blocks``, else 0.
    O(len(candidates)).
    """

    name = "llm-d"
    prefix_aware = True

    def __init__(self, *, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's weighted score, in order. O(len(candidates))."""
        queues = [c.queue_len if c.queue_len is not None else c.in_flight for c in candidates]
        high, low = max(queues), min(queues)
        result = []
        for candidate, queue in zip(candidates, queues, strict=True):
            queue_score = 1.0 if high == low else (high - queue) / (high - low)
            kv_score = 1.0 - _kv_used(candidate)
            prefix_score = _match_rate(candidate)
            result.append(
                self.prefix_weight * prefix_score + self.queue_weight * queue_score + self.kv_weight * kv_score
            )
        return result

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        scores = self.scores(candidates)
        return candidates[scores.index(max(scores))]

    def __repr__(self) -> str:
        return f"LlmdDefaultProfile(prefix={self.prefix_weight}, queue={self.queue_weight}, kv={self.kv_weight})"


class AIBrixPrefixCache(LoadPolicy):
    """AIBrix gateway's ``prefix-cache`` routing: least requests when imbalanced, else the best match within σ.

    Source: ``vllm-project/aibrix``, ``pkg/plugins/gateway/algorithms/prefix_cache.go`` (``Route``,
    ``getTargetPodOnLoadImbalance``, ``getTargetPodFromMatchedPods``); defaults
    ``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT = 8`` and
    ``AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR = 1``. Request counts are the gateway's per pod (``in_flight``).
    If ``max - min > 8``: the pod with the fewest requests. Otherwise the pods that match any of the prompt, by
    decreasing match percentage then increasing requests; the first whose requests are within ``mean + 1 × σ`` of
    all pods' (population σ) wins; with no match or none within, the fewest requests. AIBrix hashes 128-token
    blocks; this matches the router's blocks. O(B log B) for B candidates.
    """

    name = "aibrix"
    prefix_aware = True

    def __init__(self, *, imbalance_abs_count: int = 8, standard_deviation_factor: float = 1.0) -> None:
        self.imbalance_abs_count = imbalance_abs_count
        self.standard_deviation_factor = standard_deviation_factor

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        counts = [c.in_flight for c in candidates]
        fewest = min(candidates, key=lambda c: c.in_flight)
        if max(counts) - min(counts) > self.imbalance_abs_count:
            return fewest
        mean = sum(counts) / len(counts)
        sigma = math.sqrt(sum((n - mean) ** 2 for n in counts) / len(counts))
        limit = mean + self.standard_deviation_factor * sigma
        matched = sorted(
            (c for c in candidates if c.matched_tokens > 0),
            key=lambda c: (-(c.matched_tokens * 100 // c.prompt_tokens), c.in_flight),
        )
        return next((c for c in matched if c.in_flight <= limit), fewest)

    def __repr__(self) -> str:
        return (
            f"AIBrixPrefixCache(imbalance_abs_count={self.imbalance_abs_count}, "
            f"standard_deviation_factor={self.standard_deviation_factor})"
        )


class RayServePrefixAware(LoadPolicy):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``: power of two when imbalanced, else prefix match.

    Source: ``ray-project/ray``,
    ``python/ray/llm/_internal/serve/request_router/prefix_aware/prefix_aware_router.py``
    (``PrefixAwarePow2ReplicaRouter``); defaults ``imbalanced_threshold = 10`` and ``match_rate_threshold = 0.1``.
    Queue lengths are the replicas' ongoing requests (``in_flight``). If ``max - min > imbalanced_threshold``: power
    of two choices (two replicas sampled from ``rng``, the shorter queue). Otherwise the replicas with the longest
    match if its rate (matched / prompt) is at least ``match_rate_threshold``, else the replicas with the smallest
    tree (tokens routed there, :class:`_TreeSizes`); of those the shortest queue, ties by placement order. Ray matches
    characters of the prompt text; this matches the router's blocks. O(len(candidates)).
    """

    name = "ray-serve"
    prefix_aware = True

    def __init__(
        self,
        *,
        imbalanced_threshold: int = 10,
        match_rate_threshold: float = 0.1,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self._rng = _rng(seed, rng)
        self._trees = _TreeSizes()

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        queues = [c.in_flight for c in candidates]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            if len(candidates) == 1:
                return self._trees.record(candidates[0])
            first, second = sorted(self._rng.sample(range(len(candidates)), 2))
            return self._trees.record(min(candidates[first], candidates[second], key=lambda c: c.in_flight))
        longest = max(c.matched_tokens for c in candidates)
        if candidates[0].prompt_tokens and longest / candidates[0].prompt_tokens >= self.match_rate_threshold:
            chosen = [c for c in candidates if c.matched_tokens == longest]
        else:
            smallest = min(self._trees.size(c) for c in candidates)
            chosen = [c for c in candidates if self._trees.size(c) == smallest]
        return self._trees.record(min(chosen, key=lambda c: c.in_flight))

    def __repr__(self) -> str:
        return (
            f"RayServePrefixAware(imbalanced_threshold={self.imbalanced_threshold}, "
            f"match_rate_threshold={self.match_rate_threshold})"
        )


class ProductionStackPrefixAware(LoadPolicy):
    """vLLM production-stack's ``prefixaware`` routing: a random endpoint among those with the longest match.

    Source: ``vllm-project/production-stack``, ``src/vllm_router/routers/routing_logic.py`` (``PrefixAwareRouter``,
    over ``vllm_router/prefix/hashtrie.py``): the endpoints at the longest matched prefix, or every endpoint when
    nothing matches, and ``random.choice`` among them; load is not considered. The choice is drawn from ``rng``.
    O(len(candidates)).
    """

    name = "production-stack"
    prefix_aware = True

    def __init__(self, *, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = _rng(seed, rng)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        longest = max(c.matched_tokens for c in candidates)
        tied = [c for c in candidates if c.matched_tokens == longest]
        return tied[self._rng.randrange(len(tied))]


def _kv_used(candidate: Candidate) -> float:
    if candidate.kv_usage is not None:
        return candidate.kv_usage
    if candidate.capacity_blocks:
        return min(1.0, candidate.held_blocks / candidate.capacity_blocks)
    return 0.0


BASELINES: Mapping[str, type[LoadPolicy]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            SGLangCacheAware,
            DynamoKvRouter,
            LlmdDefaultProfile,
            AIBrixPrefixCache,
            RayServePrefixAware,
            ProductionStackPrefixAware,
        )
    }
)
"""The baselines by name, for ``prefixroute simulate`` and ``compare``: ``BASELINES["sglang"]()``."""
