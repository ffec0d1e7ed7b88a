"""Published routers' policies, re-implemented as reference baselines for the simulator (not core defaults).

Each class re-implements one open-source router's decision rule from its public source (named in its docstring with
the constants it took), on the information a :class:`~prefixroute.Candidate` carries. They are written from the
sources' logic, not copied. What every one of them keeps in its own index (a radix tree of request text, a hash
table of blocks) is the router's :class:`~prefixroute.PrefixIndex` here, so ``matched_tokens`` stands for their
match; where a rule needs a figure the candidate lacks, the docstring says what stands in for it. Randomised rules
take ``seed`` or ``rng`` (the simulator seeds them from ``--seed``, so runs are reproducible); where the source breaks
a tie at random, these draw it from that ``rng``, and where it breaks one by hash-map or replica-set order (fixed but
arbitrary), by placement order. Placement order is the same for every request sharing a prefix, so in place of a
random draw it would add an affinity the source does not have.

Select them by name (:data:`BASELINES`) or by path, e.g.
``prefixroute simulate --policy prefixroute.sim.baselines:SGLangCacheAware``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError
from prefixroute.policies import Candidate, LoadPolicy, _check_fields, _names_bad_fields, _require_candidates
from prefixroute.policies import _rng as seeded_rng  # the core's checks: the same errors for the same mistakes

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

    Ray Serve's router prefers the backend whose tree is smallest when nothing matches well; a routed request adds
    the part of its prompt the chosen backend's tree lacks, its uncached tokens, and nothing when every whole block
    of it matched: the router hashes no partial block, so that is what a prompt the tree holds already (an
    identical one) shows.
    """

    __slots__ = ("_sizes",)

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def size(self, candidate: Candidate) -> int:
        return self._sizes.get(candidate.backend, 0)

    def record(self, chosen: Candidate) -> Candidate:
        visible = chosen.prompt_tokens // chosen.block_size * chosen.block_size
        grown = 0 if 0 < visible <= chosen.matched_tokens else chosen.uncached_tokens
        if type(grown) is not int or grown < 0:  # a hand-built candidate's NaN would stay in every later choice
            _check_fields((chosen,), None)
        self._sizes[chosen.backend] = self._sizes.get(chosen.backend, 0) + grown
        return chosen


def _number(name: str, value: object) -> float:
    """``value`` as a plain float if it is a finite number >= 0, else a ConfigurationError naming the option."""
    number = as_float(value)
    if number is None or number < 0:
        raise ConfigurationError(f"{name} must be a finite number >= 0, not {shown(value)}")
    return number


def _number_or_inf(name: str, value: object) -> float:
    """``value`` as a plain float if it is a number >= 0 or ``math.inf`` (a threshold never crossed), else a
    ConfigurationError."""
    number = as_float(value, infinite=True)
    if number is None or number < 0:
        raise ConfigurationError(f"{name} must be a number >= 0 or math.inf, not {shown(value)}")
    return number


def _count(name: str, value: object, *, minimum: int = 0) -> int:
    """``value`` if it is an int >= ``minimum``, else a ConfigurationError naming the option."""
    count = as_int(value)
    if count is None or count < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, not {shown(value)}")
    return count


def _match_rate(candidate: Candidate) -> float:
    return candidate.matched_tokens / candidate.prompt_tokens if candidate.prompt_tokens else 0.0


class SGLangCacheAware(LoadPolicy):
    """SGLang router's ``cache_aware`` policy: shortest queue when imbalanced, else the best prefix match.

    Source: ``sgl-project/sglang``, ``sgl-model-gateway/src/policies/cache_aware.rs``
    (``CacheAwarePolicy.select_worker``, ``select_worker_min_load``); defaults from the launcher's
    ``sgl-model-gateway/bindings/python/src/sglang_router/router_args.py`` and ``sgl-model-gateway/src/main.rs``
    (formerly ``sgl-router/py_src/sglang_router/router_args.py``): ``cache_threshold = 0.3``, ``balance_abs_threshold =
    64``, ``balance_rel_threshold = 1.5`` (the Rust ``CacheAwareConfig::default()``, 0.5 / 32 / 1.1, applies only when
    the policy is built in code). Loads are the router's in-flight requests per worker (``in_flight``). The system is
    imbalanced when ``max - min > balance_abs_threshold`` **and** ``max > min × balance_rel_threshold``: then the least
    loaded worker, the first of equals in placement order (as Rust's ``min_by_key``). Otherwise the worker with the
    longest match (the first of equals in placement order, where SGLang's ``tree.rs`` ``prefix_match`` takes the first
    key of the matched node's tenant map, ``tenant_last_access_time.iter().next()``: hash-map order, fixed but
    arbitrary) if its match rate (matched / prompt) is above ``cache_threshold``, else a worker drawn from ``rng`` among
    the least loaded: sglang PR #14650 made it the least loaded rather than the smallest tree of the older
    ``sgl-router/src/policies/cache_aware.rs``, and PR #33138 draws among equals at random, so idle workers share the
    misses. SGLang matches characters of the request text; this matches the router's whole blocks, so a match ending
    within a block counts only its whole blocks (which matters near the threshold on short prompts). This follows the
    model gateway (``sgl-model-gateway``), not the separate slim ``sgl-router`` added to the repository in 2026,
    whose cache-aware policy reads the engines' KV events and differs (``cache_threshold = 0.5`` of blocks, ``32`` /
    ``1.1``, a power-of-two draw on a miss), nor the gateway's spin-off ``smg``. O(len(candidates)).
    """

    name = "sglang"
    prefix_aware = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.cache_threshold = _number("cache_threshold", cache_threshold)
        self.balance_abs_threshold = _count("balance_abs_threshold", balance_abs_threshold)
        self.balance_rel_threshold = _number("balance_rel_threshold", balance_rel_threshold)
        self._rng = seeded_rng(seed, rng, "SGLangCacheAware")

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        loads = [c.in_flight for c in candidates]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return candidates[loads.index(low)]
        best = max(candidates, key=lambda c: c.matched_tokens)
        if _match_rate(best) > self.cache_threshold:
            return best
        return self._rng.choice([c for c in candidates if c.in_flight == low])

    def __repr__(self) -> str:
        return (
            f"SGLangCacheAware(cache_threshold={self.cache_threshold}, balance_abs_threshold="
            f"{self.balance_abs_threshold}, balance_rel_threshold={self.balance_rel_threshold})"
        )


class DynamoKvRouter(LoadPolicy):
    """NVIDIA Dynamo's KV router cost: ``prefill_load_scale × prefill_blocks + decode_blocks``, lowest wins.

    Source: ``ai-dynamo/dynamo``, ``lib/kv-router/src/scheduling/selector/default.rs``
    (``DefaultWorkerScorer::worker_logit``, ``minimum_cost_index``, ``softmax_sample_index``) over
    ``selector/mod.rs`` (the worker row: ``raw_prefill_blocks``, ``decode_cost_blocks``) and
    ``lib/kv-router/src/sequences/`` (``WorkerLoadProjection::potential_decode_blocks``); defaults from its config
    (``KvRouterConfig``): ``prefill_load_scale = 1.0``, ``overlap_score_credit = 1.0``,
    ``overlap_score_credit_decay = 0.0``, ``decode_active_request_weight = 0.0``, ``router_temperature = 0.0`` (the
    host/disk/shared-cache credits apply only to tiers the candidate does not have). Per worker the logit is
    ``prefill_load_scale × max(0, raw_prefill_blocks - overlap_blocks) + decode_blocks``: ``raw_prefill_blocks`` is
    its active prefill tokens plus the request's ``isl`` over the block size, and the overlap counts whole blocks
    only, so a match ending mid-block credits its full blocks and a fully matched prompt still prefills its partial
    last block (the older ``lib/llm/src/kv_router/scheduler.rs`` wrote the same figure as
    ``overlap_score_weight × (prefill tokens - overlap_blocks × block_size) / block_size``, which is this
    ``overlap_score_weight``); ``decode_blocks`` is its *distinct* active KV blocks (every in-flight request's full
    blocks, a shared prefix counted once) plus this request's full blocks (``isl // block_size``) not among them.
    Here the active prefill tokens are ``pending_prefill_tokens``, the distinct active blocks ``active_blocks``, and
    the block size the candidate's ``block_size``. Which of the request's blocks are already active there the
    candidate does not say: an active block of this prompt is one of its matched blocks and one of the worker's
    active blocks, so at most ``min(matched blocks, active_blocks)`` of them are, and that many are taken as
    shared (exact when nothing is in flight there, or when what is in flight shares this prompt's prefix; otherwise
    an upper bound, which credits sharing that is not there and leans this baseline towards affinity). The router's
    ``active_blocks`` also counts each in-flight prompt's partial last block (as vLLM allocates it), where Dynamo
    counts whole blocks: about one block more per request in flight. Where Dynamo knows a prefill's expected
    duration it counts the oldest prefill down linearly over it (``sequences/prefill_tracker.rs``,
    ``active_tokens_at``), which it knows only with ``router_prefill_load_model = "aic"`` (default ``"none"``); the
    router, like Dynamo's default, counts a prefill in full until its first token. The engine's waiting queue
    (``queue_len``) plays no part: Dynamo's decode cost is ``potential_decode_blocks()`` alone (a July 2026
    branch that added each worker's backend-reported ``waiting_requests`` to it never reached main).

    At temperature 0 the lowest logit wins, drawn from ``rng`` among equal logits as Dynamo draws
    (``minimum_cost_index``, reservoir sampling: uniform among them; placement order, the same for every request
    sharing a prefix, would add an affinity Dynamo does not have; the older ``scheduler.rs`` broke such ties by the
    smallest indexer tree first, which the current selector no longer does). Above 0 a worker is drawn from ``rng``
    with probability ``softmax(-logit / ((max - min) × temperature))``, uniform when all logits are equal. Checked
    against dynamo 07a6c9ce (``selector/default.rs``, ``selector/mod.rs``) and again against main as of
    2026-08-21 (#13625; ``selector/default.rs``, ``selector/mod.rs``, ``sequences/prompt_registry.rs``,
    ``scheduling/config.rs``): the same rule and defaults. O(len(candidates)).
    """

    name = "dynamo"
    prefix_aware = True

    def __init__(
        self,
        *,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.overlap_score_weight = _number("overlap_score_weight", overlap_score_weight)
        self.temperature = _number("temperature", temperature)
        self._rng = seeded_rng(seed, rng, "DynamoKvRouter")

    def logit(self, candidate: Candidate) -> float:
        """The worker's cost for this request (lower is better). O(1)."""
        size = candidate.block_size
        request_blocks = candidate.prompt_tokens // size
        matched_blocks = min(candidate.matched_tokens // size, request_blocks)
        prefill_blocks = (candidate.pending_prefill_tokens + candidate.prompt_tokens - matched_blocks * size) / size
        already_active = min(matched_blocks, candidate.active_blocks)
        decode_blocks = candidate.active_blocks + request_blocks - already_active
        return self.overlap_score_weight * prefill_blocks + decode_blocks

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        logits = [self.logit(c) for c in candidates]
        if self.temperature == 0.0:  # uniform among the lowest, as minimum_cost_index's reservoir sampling
            lowest = min(logits)
            return self._rng.choice([c for c, value in zip(candidates, logits, strict=True) if value == lowest])
        low, high = min(logits), max(logits)
        if high == low:
            weights = [1.0] * len(candidates)
        else:
            weights = [math.exp(-(value - low) / (high - low) / self.temperature) for value in logits]
        return self._rng.choices(candidates, weights=weights)[0]

    def __repr__(self) -> str:
        return f"DynamoKvRouter(overlap_score_weight={self.overlap_score_weight}, temperature={self.temperature})"


class LlmdDefaultProfile(LoadPolicy):
    """llm-d's default scheduling profile: prefix-cache (weight 3) + queue (2) + KV-utilisation (2) scorers.

    Source: ``llm-d/llm-d-router`` (formerly ``llm-d/llm-d-inference-scheduler``), ``pkg/epp/config/loader/defaults.go``
    (``loadDefaultConfig``: ``queue-scorer`` 2, ``kv-cache-utilization-scorer`` 2, ``prefix-cache-scorer`` 3;
    ``ensureSchedulingLayer`` adds the ``max-score-picker``) and, under ``pkg/epp/framework/plugins/``,
    ``scheduling/scorer/prefix/plugin.go`` (``matchLengthWeight = 0``: the match ratio alone),
    ``scheduling/scorer/queuedepth/queue.go``, ``scheduling/scorer/kvcacheutilization/kvcache_utilization.go``,
    ``scheduling/picker/maxscore/picker.go``, ``requestcontrol/dataproducer/approximateprefix/`` (``plugin.go``:
    ``GetBlockSize``, ``minBlockSizeTokens = 64``, ``resolveMaxBlocks``; ``types.go``: ``defaultMaxPrefixTokens =
    131072``, ``autoTune`` on) and ``requestcontrol/dataproducer/prefixhash/hashing.go`` (``GetBlockHashes``); the
    same scorers as ``kubernetes-sigs/gateway-api-inference-extension``. Prefix = matched blocks / the request's
    blocks, in blocks of ``max(block size, 64)`` tokens (llm-d takes the engine's block size, 16 on vLLM, and raises
    it to 64); the request's blocks count a partial last block, matched only when the whole prompt is (a prompt
    under one block is that one partial block), and both stop at ``131072 // block`` blocks (a longer prompt is
    hashed up to there only). The router's index hashes whole blocks only, so the whole prompt counts as matched
    when every whole router block of it is: an identical earlier prompt, which llm-d matches to the end, shows as no
    more (a longer earlier prompt sharing those blocks does too, where llm-d's partial block would differ). Queue =
    ``(max - q) / (max - min)`` over the endpoints' waiting queues, 1 for all when equal; KV = ``1 - kv_usage``;
    each clamped to [0, 1] before weighting (``enforceScoreRange`` in
    ``pkg/epp/scheduling/scheduler_profile.go``). The highest weighted sum wins, drawn from ``rng`` among equal sums
    as the picker's shuffle draws (placement order, the same for every request sharing a prefix, would add an
    affinity llm-d does not have). The queue is the engine's ``queue_len`` (vLLM's waiting requests) when metrics
    supply it, else the router's ``in_prefill`` (its requests without a first token yet: waiting, or in prefill),
    the nearest it knows to a waiting queue (``in_flight`` would count every decoding request too, which llm-d's
    queue scorer never sees); KV use is the engine's ``kv_usage``, else ``active_blocks / capacity_blocks`` (the KV
    memory its requests hold), else 0. The block size below 64 is the candidate's ``block_size``; llm-d hashes the
    tokens of its default ``estimate`` tokenizer (4 bytes each), for which the prompt's tokens stand in. Checked
    against llm-d-router ebab6879 (2026-08-21). O(len(candidates)).
    """

    name = "llm-d"
    prefix_aware = True

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        max_prefix_tokens: int = 131072,
        min_block_tokens: int = 64,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.prefix_weight = _number("prefix_weight", prefix_weight)
        self.queue_weight = _number("queue_weight", queue_weight)
        self.kv_weight = _number("kv_weight", kv_weight)
        self.max_prefix_tokens = _count("max_prefix_tokens", max_prefix_tokens, minimum=1)
        self.min_block_tokens = _count("min_block_tokens", min_block_tokens, minimum=1)
        self._rng = seeded_rng(seed, rng, "LlmdDefaultProfile")

    def prefix_score(self, candidate: Candidate) -> float:
        """The prefix-cache scorer's value: matched blocks over the request's blocks, both capped. O(1).

        Blocks are ``max(block_size, min_block_tokens)`` tokens. llm-d hashes a partial last block too, so it matches
        only when the whole prompt is cached; a prompt shorter than one block is that one partial block. The router
        matches its own whole blocks, so a match ending within an llm-d block counts only llm-d's whole blocks
        within it, and the whole prompt counts as cached when all of its whole router blocks are matched (the most
        an identical earlier prompt can show; under one router block nothing shows, and nothing matches).
        """
        size = max(candidate.block_size, self.min_block_tokens)
        total = min(-(-candidate.prompt_tokens // size), self.max_prefix_tokens // size)
        if total <= 0:
            return 0.0
        visible = candidate.prompt_tokens // candidate.block_size * candidate.block_size
        whole = candidate.matched_tokens >= candidate.prompt_tokens or 0 < visible <= candidate.matched_tokens
        matched = total if whole else min(candidate.matched_tokens // size, total)
        return matched / total

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's weighted score, in order. O(len(candidates))."""
        queues = [c.queue_len if c.queue_len is not None else c.in_prefill for c in candidates]
        high, low = max(queues), min(queues)
        result = []
        for candidate, queue in zip(candidates, queues, strict=True):
            queue_score = 1.0 if high == low else (high - queue) / (high - low)
            kv_score = min(1.0, max(0.0, 1.0 - _kv_used(candidate)))  # enforceScoreRange clamps every scorer
            result.append(
                self.prefix_weight * self.prefix_score(candidate)
                + self.queue_weight * queue_score
                + self.kv_weight * kv_score
            )
        return result

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        scores = self.scores(candidates)
        best = max(scores)  # the max-score picker shuffles before its stable sort: uniform among the highest
        return self._rng.choice([c for c, score in zip(candidates, scores, strict=True) if score == best])

    def __repr__(self) -> str:
        return (
            f"LlmdDefaultProfile(prefix={self.prefix_weight}, queue={self.queue_weight}, kv={self.kv_weight}, "
            f"max_prefix_tokens={self.max_prefix_tokens}, min_block_tokens={self.min_block_tokens})"
        )


class AIBrixPrefixCache(LoadPolicy):
    """AIBrix gateway's ``prefix-cache`` routing: the best match within ``mean + σ`` requests, else the fewest.

    Source: ``vllm-project/aibrix``, ``pkg/plugins/gateway/algorithms/prefix_cache.go`` (``routeOriginal``,
    ``getTargetPodListOnLoadImbalance``, ``getTargetPodFromMatchedPods``), ``algorithms/util.go`` (``mean``,
    ``standardDeviation``), ``algorithms/least_request.go`` (``selectTargetPodWithLeastRequestCount``) and
    ``pkg/utils/prefixcacheindexer/hash.go`` (``seqSearchPrefix``, ``getPrefixHashes``); defaults
    ``AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT = 8`` and
    ``AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR = 1``. Request counts are the gateway's running requests per pod
    (``in_flight``). If ``max - min > 8`` only the pods with the fewest requests are matched against; otherwise
    all. Of the matched pods (a matched block, even one under 1 %), by decreasing match percentage
    (``matched × 100 // total`` full blocks) then increasing requests, the first whose requests are at most
    ``mean + 1 × σ`` over *all* pods (σ the sample standard deviation, 0 for one pod) wins; with no match or none
    within, the pod with the fewest requests. Ties are drawn from ``rng``, as AIBrix draws them: it shuffles the
    matched pods before its stable sort, and takes ``rand.Intn`` among the pods at the fewest requests (placement
    order, the same for every request sharing a prefix, would add an affinity AIBrix does not have). AIBrix hashes
    4-character blocks of the text by default; this matches the router's blocks (the candidate's ``block_size``).
    Checked against aibrix e3e10f9e (2026-08-23). O(len(candidates)).
    """

    name = "aibrix"
    prefix_aware = True

    def __init__(
        self,
        *,
        imbalance_abs_count: int = 8,
        standard_deviation_factor: float = 1.0,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.imbalance_abs_count = _count("imbalance_abs_count", imbalance_abs_count)
        self.standard_deviation_factor = _number("standard_deviation_factor", standard_deviation_factor)
        self._rng = seeded_rng(seed, rng, "AIBrixPrefixCache")

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        counts = [c.in_flight for c in candidates]
        fewest = min(counts)
        searched: Sequence[Candidate] = candidates
        if max(counts) - fewest > self.imbalance_abs_count:
            searched = [c for c in candidates if c.in_flight == fewest]
        mean = sum(counts) / len(counts)
        spread = sum((n - mean) ** 2 for n in counts)
        sigma = math.sqrt(spread / (len(counts) - 1)) if len(counts) > 1 else 0.0
        limit = mean + self.standard_deviation_factor * sigma
        # The first of the matched pods, by decreasing match percentage then increasing requests, that is within the
        # limit: the lowest (-percent, requests) among those within it, drawn among equals (AIBrix shuffles first).
        within = [c for c in searched if c.matched_tokens >= c.block_size and c.in_flight <= limit]
        if within:
            best = min(map(_aibrix_order, within))
            return self._rng.choice([c for c in within if _aibrix_order(c) == best])
        return self._rng.choice([c for c in candidates if c.in_flight == fewest])

    def __repr__(self) -> str:
        return (
            f"AIBrixPrefixCache(imbalance_abs_count={self.imbalance_abs_count}, "
            f"standard_deviation_factor={self.standard_deviation_factor})"
        )


def _aibrix_order(candidate: Candidate) -> tuple[int, int]:
    """AIBrix's order of matched pods: decreasing match percentage, then increasing requests."""
    return -_match_percent(candidate), candidate.in_flight


def _match_percent(candidate: Candidate) -> int:
    """AIBrix's match percentage: matched full blocks × 100 // the prompt's full blocks."""
    total = candidate.prompt_tokens // candidate.block_size
    return min(candidate.matched_tokens // candidate.block_size, total) * 100 // total if total else 0


class RayServePrefixAware(LoadPolicy):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``: the longest match, else the smallest tree; shortest queue.

    Source: ``ray-project/ray`` main,
    ``python/ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py`` (formerly under
    ``request_router/prefix_aware/``: ``initialize_state``, ``_prefix_match_best_replicas``, ``choose_replicas``)
    over ``prefix_tree.py`` (``prefix_match``, ``get_smallest_tenants``), ``python/ray/serve/_private/request_router/
    pow_2_router.py`` (an ordered pair of replicas drawn uniformly at random) and ``request_router.py``
    (``_select_from_candidate_replicas``: the lowest queue, the first of equals in the order given); defaults
    ``imbalanced_threshold = inf`` (ray PR #59390; it was 10 before, pass ``imbalanced_threshold=10`` for that
    router) and ``match_rate_threshold = 0.1``. Queue lengths are the replicas' ongoing requests (``in_flight``). If
    ``max - min > imbalanced_threshold`` (never at the default): power of two choices, two replicas drawn from
    ``rng`` in sample order and the shorter queue, the first drawn of equals. Otherwise the replicas with the
    longest match if its rate (matched / prompt, 0 for an empty prompt) is at least ``match_rate_threshold``, else
    the replicas with the smallest tree; of those the shortest queue, ties by placement order (Ray's order there is
    that of its replica set and tenant map). A tree's size is the tokens routed there that the backend did not
    match (:class:`_TreeSizes`), where Ray counts the characters its never-evicting tree gained for that replica;
    a prompt whose whole blocks all matched adds nothing, as an identical one adds nothing to Ray's tree. Ray
    matches characters of the prompt text; this matches the router's blocks, so a match ending within a block
    grows the tree by the rest of that block more than Ray's (less than one block per request), and one the
    router's index has evicted by the evicted part. Ray also passes over a replica
    whose queue is at its ``max_ongoing_requests``, which the candidate does not say. O(len(candidates)).
    """

    name = "ray-serve"
    prefix_aware = True

    def __init__(
        self,
        *,
        imbalanced_threshold: float = math.inf,
        match_rate_threshold: float = 0.1,
        seed: int | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.imbalanced_threshold = _number_or_inf("imbalanced_threshold", imbalanced_threshold)
        self.match_rate_threshold = _number("match_rate_threshold", match_rate_threshold)
        self._rng = seeded_rng(seed, rng, "RayServePrefixAware")
        self._trees = _TreeSizes()

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        queues = [c.in_flight for c in candidates]
        if max(queues) - min(queues) > self.imbalanced_threshold:  # never for one candidate: the threshold is >= 0
            # Ray keeps the sampled order: of two equal queues the first drawn wins.
            first, second = self._rng.sample(range(len(candidates)), 2)
            return self._trees.record(min(candidates[first], candidates[second], key=lambda c: c.in_flight))
        longest = max(c.matched_tokens for c in candidates)
        prompt = candidates[0].prompt_tokens
        if (longest / prompt if prompt else 0.0) >= self.match_rate_threshold:
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

    Source: ``vllm-project/production-stack``, ``src/vllm_router/routers/routing_logic.py``
    (``PrefixAwareRouter.route_request``) over ``src/vllm_router/prefix/hashtrie.py`` (``longest_prefix_match`` of
    128-character chunks): the endpoints at the longest matched prefix, or every endpoint when nothing matches, and
    ``random.choice`` among them; load is not considered (the QPS fallback applies only below
    ``prefix_min_match_length``, 0 by default, so never). The choice is drawn from ``rng``. The trie compares
    whole 128-character chunks (a partial last chunk included), so matches ending within one chunk tie there; here
    they tie only at the same number of the router's blocks. O(len(candidates)).
    """

    name = "production-stack"
    prefix_aware = True

    def __init__(self, *, seed: int | None = None, rng: random.Random | None = None) -> None:
        self._rng = seeded_rng(seed, rng, "ProductionStackPrefixAware")

    @_names_bad_fields
    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        _require_candidates(candidates)
        longest = max(c.matched_tokens for c in candidates)
        tied = [c for c in candidates if c.matched_tokens == longest]
        return tied[self._rng.randrange(len(tied))]


def _kv_used(candidate: Candidate) -> float:
    if candidate.kv_usage is not None:
        return candidate.kv_usage
    if candidate.capacity_blocks:
        return min(1.0, candidate.active_blocks / candidate.capacity_blocks)
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
