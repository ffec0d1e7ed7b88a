"""Differential tests: each published baseline against a second, independent re-implementation of its rule.

The reference rules below were first written from the upstream sources, before reading
``prefixroute/sim/baselines.py``, in the terms the upstream router sees (its own index's match, its request counts,
scraped metrics), not in :class:`~prefixroute.Candidate` fields. Sources read: sgl-project/sglang
``sgl-model-gateway/src/policies/cache_aware.rs`` (b93974f1, and PR #33138), ai-dynamo/dynamo
``lib/kv-router/src/scheduling/selector.rs`` (01690d42), llm-d/llm-d-inference-scheduler (now llm-d-router; 520af478
and the approximateprefix/prefixhash producers after it), vllm-project/aibrix (e3e10f9e), the ray 2.60.0 wheel, and
vllm-project/production-stack (a6c01db0). Each test draws that upstream view, builds the candidates the router would
hand the baseline for it, and checks that the baseline's choice is one the upstream router could make: a set, where
upstream breaks ties at random or by hash-map order. The draws lean on the thresholds (a match rate of exactly 0.3
or 0.1, loads 1.5 or 64 apart, counts where the sample and population deviations disagree): a small change to any
baseline's rule fails one of these tests.

Where a baseline states an approximation (the router's whole blocks stand in for another index's units, Dynamo's
shared active blocks are bounded rather than known), the exact comparison is drawn only where the approximation is
exact, and another test checks the stated bound or follows a sequence of requests whose history settles it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute import Candidate
from prefixroute.sim.baselines import (
    AIBrixPrefixCache,
    DynamoKvRouter,
    LlmdDefaultProfile,
    ProductionStackPrefixAware,
    RayServePrefixAware,
    SGLangCacheAware,
)

EXAMPLES = settings(max_examples=700, deadline=None)
TOLERANCE = 1e-9  # scores summed in another order may differ in the last bits: equal within this is a tie


def _near_best(values: Sequence[float], *, lowest: bool) -> set[int]:
    best = min(values) if lowest else max(values)
    return {i for i, value in enumerate(values) if abs(value - best) <= TOLERANCE * max(1.0, abs(best))}


# -- the upstream views ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    block_size: int  # the router's block, which the baselines' docstrings say stands in for each index's unit


@dataclass(frozen=True)
class Worker:
    """One backend as the upstream routers see it: its index's match in the router's whole blocks, and its load."""

    matched_blocks: int
    in_flight: int  # the gateway's own outstanding requests (SGLang load(), AIBrix running, Ray queue length)
    waiting: int  # the engine's waiting queue (vLLM num_requests_waiting, llm-d's queue scorer)
    kv_usage: float  # the engine's KV cache usage fraction


def _candidate(index: int, worker: Worker, request: Request) -> Candidate:
    return Candidate(
        f"w{index}",
        worker.matched_blocks * request.block_size,
        request.prompt_tokens,
        worker.in_flight,
        queue_len=worker.waiting,
        kv_usage=worker.kv_usage,
        block_size=request.block_size,
    )


@st.composite
def requests(draw: st.DrawFn) -> Request:
    block_size = draw(st.sampled_from([1, 4, 16, 16, 16, 32, 64, 128]))
    # Prompts of 10 or 20 whole blocks put a match rate exactly on SGLang's 0.3 and Ray's 0.1.
    aligned = st.sampled_from([10, 20, 30]).map(lambda blocks: blocks * block_size)
    long = st.integers(100_000, 270_000)  # past llm-d's 131072-token cap
    return Request(draw(st.integers(0, 4096) | aligned | long), block_size)


# Loads on the thresholds: 130 and 195 differ by 65 > 64 with 195 = 1.5 x 130, and 64 and 65 apart (SGLang); 8 and 9
# apart, and 0, 1, 2, where 2 is within the mean plus the sample standard deviation but not the population one (AIBrix).
SGLANG_LOADS = ([130, 195], [0, 64], [0, 65])
AIBRIX_LOADS = ([3, 11], [2, 11], [0, 1, 2], [0, 9])


@st.composite
def workers(draw: st.DrawFn, request: Request, *, loads: int, profiles: Sequence[list[int]]) -> list[Worker]:
    """1 to 6 workers whose matches and loads come from a few shared values, so that ties are common."""
    whole = request.prompt_tokens // request.block_size
    # Levels on the thresholds too: a tenth (Ray), three tenths (SGLang), all but one block, all.
    levels = [whole // 10, whole * 3 // 10, max(0, whole - 1), whole]
    match = st.integers(0, whole) | st.sampled_from([level for level in levels if level <= whole])
    # Two adjacent matches of the same integer percentage once the prompt has over 100 blocks (AIBrix's sort key).
    matches = draw(st.lists(match, min_size=1, max_size=3) | st.just([whole // 2, min(whole, whole // 2 + 1)]))
    queues = draw(st.lists(st.integers(0, 20), min_size=1, max_size=3))
    usages = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]) | st.floats(0, 1), min_size=1, max_size=3))
    # Three times in four (given profiles), every load of a boundary profile is there, in any order, then more of them.
    if profiles and draw(st.integers(0, 3)) > 0:
        profile = draw(st.sampled_from(profiles))
        counts = draw(st.permutations(profile + draw(st.lists(st.sampled_from(profile), max_size=3))))
    else:
        shared = draw(st.lists(st.integers(0, loads) | st.integers(0, 4), min_size=1, max_size=3))
        counts = [draw(st.sampled_from(shared)) for _ in range(draw(st.integers(1, 6)))]
    return [
        Worker(
            draw(st.sampled_from(matches)),
            count,
            draw(st.sampled_from(queues)),
            draw(st.sampled_from(usages)),
        )
        for count in counts
    ]


@st.composite
def fleets(draw: st.DrawFn, *, loads: int = 12, profiles: Sequence[list[int]] = ()) -> tuple[Request, list[Worker]]:
    request = draw(requests())
    return request, draw(workers(request, loads=loads, profiles=profiles))


def _drawn_choices(
    policy: type[SGLangCacheAware] | type[ProductionStackPrefixAware] | type[AIBrixPrefixCache],
    candidates: list[Candidate],
) -> set[int]:
    """The choices of 32 seeded instances (where upstream draws at random among equals, more than one of them)."""
    return {candidates.index(policy(seed=seed).choose(candidates)) for seed in range(32)}


# -- SGLang cache_aware ----------------------------------------------------------------------------------------------


def sglang_choices(request: Request, fleet: Sequence[Worker], *, threshold: float = 0.3) -> tuple[set[int], bool]:
    """sgl-project/sglang sgl-model-gateway/src/policies/cache_aware.rs ``select_worker`` (after PR #14650, #33138).

    Imbalanced (max - min > 64 and max > 1.5 min): ``min_by_key`` over the loads, the first minimum. Balanced: the
    tenant of the deepest matched tree node (any of those with the longest match) when matched / text > 0.3, else a
    random one of the least loaded. Returns the choices and whether upstream draws among them at random.
    """
    loads = [w.in_flight for w in fleet]
    high, low = max(loads), min(loads)
    if high - low > 64 and high > low * 1.5:
        return {loads.index(low)}, False
    deepest = max(w.matched_blocks for w in fleet)
    text = request.prompt_tokens
    if text and deepest * request.block_size / text > threshold:
        return {i for i, w in enumerate(fleet) if w.matched_blocks == deepest}, False
    return {i for i, load in enumerate(loads) if load == low}, True


@EXAMPLES
@given(fleets(loads=200, profiles=SGLANG_LOADS))
def test_sglang_chooses_as_the_gateway_would(drawn: tuple[Request, list[Worker]]) -> None:
    request, fleet = drawn
    candidates = [_candidate(i, w, request) for i, w in enumerate(fleet)]
    expected, at_random = sglang_choices(request, fleet)
    drawn_choices = _drawn_choices(SGLangCacheAware, candidates)
    assert drawn_choices <= expected
    assert len(drawn_choices) > 1 if at_random and len(expected) > 1 else True
    # (a miss goes to any of the least loaded, PR #33138; a hit to the tree's first tenant, hash-map order)


# -- Dynamo KV router ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamoWorker:
    """Dynamo's per-worker load projection (lib/kv-router/src/sequences: ``WorkerLoadProjection``)."""

    overlap_blocks: int  # the indexer's consecutive matched blocks
    active_prefill_tokens: int  # uncached prompt tokens of its requests still in prefill
    shared_blocks: int  # of this request's full blocks, those already active there (a request in flight shares them)
    other_active_blocks: int  # active blocks there that this request does not share


def dynamo_logit(request: Request, worker: DynamoWorker, *, overlap_score_weight: float = 1.0) -> float:
    """lib/kv-router/src/scheduling/selector.rs ``worker_logit`` at the config defaults.

    ``prefill_load_scale × max(0, (active_prefill_tokens + isl) / block - credit × overlap) + potential_decode_blocks``
    with potential decode = active decode blocks + the request's full blocks not already active; the deprecated
    ``overlap_score_weight`` sets ``prefill_load_scale`` (and a credit of 0 when it is 0).
    """
    size, isl = request.block_size, request.prompt_tokens
    credit = 0.0 if overlap_score_weight == 0 else 1.0
    raw_prefill_blocks = (worker.active_prefill_tokens + isl) / size
    prefill = overlap_score_weight * max(0.0, raw_prefill_blocks - credit * worker.overlap_blocks)
    active = worker.shared_blocks + worker.other_active_blocks
    additional = isl // size - worker.shared_blocks
    return prefill + active + additional


@st.composite
def dynamo_fleets(draw: st.DrawFn, *, exact: bool) -> tuple[Request, list[DynamoWorker]]:
    request = draw(requests())
    whole = request.prompt_tokens // request.block_size
    fleet = []
    for _ in range(draw(st.integers(1, 6))):
        overlap = draw(st.integers(0, whole))
        shared = draw(st.integers(0, overlap))  # an active block of this prompt is in the cache, so matched
        other = draw(st.integers(0, 300))
        if exact:  # the candidate says only how many blocks are active: exact when all or none of them are shared
            other, shared = draw(st.sampled_from([(0, shared), (other, overlap)]))
        fleet.append(DynamoWorker(overlap, draw(st.integers(0, 5000)), shared, other))
    return request, fleet


def _dynamo_candidate(index: int, worker: DynamoWorker, request: Request) -> Candidate:
    return Candidate(
        f"w{index}",
        worker.overlap_blocks * request.block_size,
        request.prompt_tokens,
        0,
        pending_prefill_tokens=worker.active_prefill_tokens,
        active_blocks=worker.shared_blocks + worker.other_active_blocks,
        block_size=request.block_size,
    )


@EXAMPLES
@given(dynamo_fleets(exact=True), st.sampled_from([1.0, 0.0, 0.5, 2.0]))
def test_dynamo_costs_and_chooses_as_its_selector_would(
    drawn: tuple[Request, list[DynamoWorker]], weight: float
) -> None:
    request, fleet = drawn
    policy = DynamoKvRouter(overlap_score_weight=weight)
    candidates = [_dynamo_candidate(i, w, request) for i, w in enumerate(fleet)]
    expected = [dynamo_logit(request, w, overlap_score_weight=weight) for w in fleet]
    assert [policy.logit(c) for c in candidates] == [pytest.approx(x, rel=TOLERANCE, abs=TOLERANCE) for x in expected]
    assert candidates.index(policy.choose(candidates)) in _near_best(expected, lowest=True)
    # minimum_cost_index draws among equal costs (reservoir sampling): seeded instances do not all take one of them.
    ours = [policy.logit(c) for c in candidates]
    tied = [i for i, value in enumerate(ours) if value == min(ours)]
    picks = {
        candidates.index(DynamoKvRouter(overlap_score_weight=weight, seed=s).choose(candidates)) for s in range(32)
    }
    assert picks <= set(tied) and (len(picks) > 1 if len(tied) > 1 else True)


@EXAMPLES
@given(dynamo_fleets(exact=False))
def test_dynamo_cost_is_at_most_the_selectors_when_sharing_is_unknown(
    drawn: tuple[Request, list[DynamoWorker]],
) -> None:
    # The docstring's bound: min(matched blocks, active blocks) of the request's blocks are taken as already active,
    # at least as many as are, so the cost is never above Dynamo's and short of it by the blocks wrongly taken.
    request, fleet = drawn
    for index, worker in enumerate(fleet):
        ours = DynamoKvRouter().logit(_dynamo_candidate(index, worker, request))
        theirs = dynamo_logit(request, worker)
        assumed = min(worker.overlap_blocks, worker.shared_blocks + worker.other_active_blocks)
        assert ours == pytest.approx(theirs - (assumed - worker.shared_blocks), rel=TOLERANCE, abs=TOLERANCE)


# -- llm-d default profile -------------------------------------------------------------------------------------------


def llmd_scores(fleet: Sequence[Worker], matched: Sequence[int], total: int) -> list[float]:
    """llm-d-router's default profile (pkg/epp/config/loader/defaults.go): queue-scorer 2, kv-cache-utilization-scorer
    2, prefix-cache-scorer 3, summed in that order after enforceScoreRange, max-score-picker (shuffled: random ties).

    ``matched`` is each endpoint's consecutive matched llm-d blocks out of the request's ``total``.
    """
    queues = [w.waiting for w in fleet]
    high, low = max(queues), min(queues)
    scores = []
    for worker, blocks in zip(fleet, matched, strict=True):
        queue = 1.0 if high == low else (high - worker.waiting) / (high - low)
        kv = 1 - worker.kv_usage
        prefix = blocks / total if total else 0.0
        scores.append(sum(weight * min(1.0, max(0.0, s)) for weight, s in ((2, queue), (2, kv), (3, prefix))))
    return scores


def llmd_blocks(request: Request) -> tuple[int, int]:
    """The llm-d block (GetBlockSize: at least minBlockSizeTokens = 64) and the request's blocks, a partial last one
    included, capped at defaultMaxPrefixTokens = 131072 tokens (prefixhash GetBlockHashes, hashPrompt)."""
    size = max(request.block_size, 64)
    return size, min(-(-request.prompt_tokens // size), 131072 // size)


@EXAMPLES
@given(fleets())
def test_llmd_scores_and_chooses_as_its_default_profile_would(drawn: tuple[Request, list[Worker]]) -> None:
    # What llm-d's index holds for an endpoint is what was routed there, as the router's index: its whole llm-d
    # blocks within the router's match. Beyond that a partial last llm-d block matches after an identical prompt,
    # not after a longer one, which the router cannot tell apart when all of its whole blocks match: that case is
    # left to the sequence test below, where what was routed is known.
    request, fleet = drawn
    size, total = llmd_blocks(request)
    visible = request.prompt_tokens // request.block_size * request.block_size
    whole_is_exact = request.prompt_tokens % size == 0  # no partial llm-d block
    fleet = [w for w in fleet if whole_is_exact or w.matched_blocks * request.block_size < visible]
    fleet = fleet or [Worker(0, 0, 0, 0.0)]
    matched = [min(w.matched_blocks * request.block_size // size, total) for w in fleet]
    candidates = [_candidate(i, w, request) for i, w in enumerate(fleet)]
    expected = llmd_scores(fleet, matched, total)
    policy = LlmdDefaultProfile()
    assert policy.scores(candidates) == [pytest.approx(x, rel=TOLERANCE, abs=TOLERANCE) for x in expected]
    assert candidates.index(policy.choose(candidates)) in _near_best(expected, lowest=False)
    # The max-score picker shuffles before its stable sort: seeded instances do not all take one of equal scores.
    ours = policy.scores(candidates)
    tied = [i for i, value in enumerate(ours) if value == max(ours)]
    picks = {candidates.index(LlmdDefaultProfile(seed=s).choose(candidates)) for s in range(32)}
    assert picks <= set(tied) and (len(picks) > 1 if len(tied) > 1 else True)


class LlmdIndex:
    """llm-d's approximate prefix index (approximateprefix/plugin.go ``PreRequest``, ``matchLongestPrefix``): the
    chosen endpoint records the request's block hashes, and an endpoint matches a request's leading run of them."""

    def __init__(self, endpoints: int) -> None:
        self.hashes: list[set[tuple[int, ...]]] = [set() for _ in range(endpoints)]

    @staticmethod
    def blocks(prompt: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
        """hashPrompt: chained blocks of ``size`` tokens, a partial last one included (a chain is its whole prefix)."""
        return [prompt[: min(end, len(prompt))] for end in range(size, len(prompt) + size, size)]

    def match(self, endpoint: int, blocks: Sequence[tuple[int, ...]]) -> int:
        return _leading_run(blocks, self.hashes[endpoint])


def _leading_run(blocks: Sequence[tuple[int, ...]], held: set[tuple[int, ...]]) -> int:
    """How many of ``blocks``, from the first, are in ``held``."""
    run = 0
    while run < len(blocks) and blocks[run] in held:
        run += 1
    return run


@st.composite
def chat_prompts(draw: st.DrawFn, prefixes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """A shared prefix and one of a few questions of at least two router blocks (each opening with its own token),
    so two different prompts part before the last whole router block, and a prompt recurs whole when drawn again."""
    which = draw(st.integers(0, len(prefixes) - 1))
    question = draw(st.integers(0, 2))
    length = 32 + (which * 7 + question * 13) % 50
    return prefixes[which] + (1000 + which * 10 + question,) * length


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_llmd_follows_a_sequence_of_requests_as_its_prefix_index_would(data: st.DataObject, endpoints: int) -> None:
    # The router's index and llm-d's both hold what was routed to each endpoint; llm-d hashes a partial last block
    # too, which an identical earlier prompt matches though the router cannot see past its last whole block.
    size, block_size = 64, 16
    prefixes = [tuple([p] * data.draw(st.integers(0, 300))) for p in range(3)]
    llmd = LlmdIndex(endpoints)
    router: list[set[tuple[int, ...]]] = [set() for _ in range(endpoints)]
    policy = LlmdDefaultProfile(seed=0)  # equal scores are drawn at random: seeded, so an example replays
    for _ in range(data.draw(st.integers(1, 20))):
        prompt = data.draw(chat_prompts(prefixes))
        fleet = [
            Worker(0, 0, data.draw(st.integers(0, 3)), data.draw(st.sampled_from([0.0, 0.5, 0.9])))
            for _ in range(endpoints)
        ]
        # The router's index: the prompt's whole blocks only (BlockHasher hashes no partial block).
        visible = LlmdIndex.blocks(prompt[: len(prompt) // block_size * block_size], block_size)
        matched_tokens = [_leading_run(visible, router[e]) * block_size for e in range(endpoints)]
        blocks = LlmdIndex.blocks(prompt, size)
        expected = llmd_scores(fleet, [llmd.match(e, blocks) for e in range(endpoints)], len(blocks))
        candidates = [
            Candidate(f"e{e}", matched_tokens[e], len(prompt), 0, queue_len=w.waiting, kv_usage=w.kv_usage)
            for e, w in enumerate(fleet)
        ]
        assert policy.scores(candidates) == [pytest.approx(x, rel=TOLERANCE, abs=TOLERANCE) for x in expected]
        chosen = candidates.index(policy.choose(candidates))
        llmd.hashes[chosen].update(blocks)
        router[chosen].update(visible)


# -- AIBrix prefix-cache ---------------------------------------------------------------------------------------------


def aibrix_choices(request: Request, fleet: Sequence[Worker]) -> set[int]:
    """vllm-project/aibrix pkg/plugins/gateway/algorithms/prefix_cache.go ``routeOriginal`` at its defaults.

    Imbalanced (max - min running > 8): only the least loaded pods are matched. The matched pods (a matched block at
    least) by decreasing ``matched × 100 / total`` (integer), then increasing requests, random among equals; the
    first within mean + 1 × sample σ of all pods' requests wins, else a random pod of the fewest requests.
    """
    counts = [w.in_flight for w in fleet]
    fewest = min(counts)
    searched: Sequence[int] = range(len(fleet))
    if max(counts) - fewest > 8:
        searched = [i for i in searched if counts[i] == fewest]
    total = request.prompt_tokens // request.block_size
    percent = {i: fleet[i].matched_blocks * 100 // total for i in searched if total and fleet[i].matched_blocks}
    mean = sum(counts) / len(counts)
    sigma = 0.0 if len(counts) < 2 else math.sqrt(sum((n - mean) ** 2 for n in counts) / (len(counts) - 1))
    within = [i for i in percent if counts[i] <= mean + sigma]
    if not within:
        return {i for i, n in enumerate(counts) if n == fewest}
    top = max(percent[i] for i in within)
    lightest = min(counts[i] for i in within if percent[i] == top)
    return {i for i in within if percent[i] == top and counts[i] == lightest}


@EXAMPLES
@given(fleets(loads=30, profiles=AIBRIX_LOADS))
def test_aibrix_chooses_as_its_gateway_would(drawn: tuple[Request, list[Worker]]) -> None:
    request, fleet = drawn
    candidates = [_candidate(i, w, request) for i, w in enumerate(fleet)]
    expected, drawn_choices = aibrix_choices(request, fleet), _drawn_choices(AIBrixPrefixCache, candidates)
    assert drawn_choices <= expected
    assert len(drawn_choices) > 1 if len(expected) > 1 else True  # rand.Shuffle / rand.Intn among them


# -- production-stack prefixaware ------------------------------------------------------------------------------------


def production_stack_choices(fleet: Sequence[Worker]) -> set[int]:
    """vllm-project/production-stack routing_logic.py ``PrefixAwareRouter`` over hashtrie.py ``longest_prefix_match``:
    ``random.choice`` among the endpoints at the longest matched chunk, every endpoint when none matches."""
    longest = max(w.matched_blocks for w in fleet)
    return {i for i, w in enumerate(fleet) if w.matched_blocks == longest}


@EXAMPLES
@given(fleets())
def test_production_stack_chooses_as_its_router_would(drawn: tuple[Request, list[Worker]]) -> None:
    request, fleet = drawn
    candidates = [_candidate(i, w, request) for i, w in enumerate(fleet)]
    expected, drawn_choices = production_stack_choices(fleet), _drawn_choices(ProductionStackPrefixAware, candidates)
    assert drawn_choices <= expected
    assert len(drawn_choices) > 1 if len(expected) > 1 else True  # random.choice among them, not always one


# -- Ray Serve PrefixCacheAffinityRouter: a sequence of requests, the tree kept as Ray keeps it ------------------------


class RayTree:
    """Ray's PrefixTreeActor (prefix_tree.py), on tokens: a per-replica trie that never evicts (do_eviction False)."""

    def __init__(self, replicas: int) -> None:
        self.prompts: list[list[tuple[int, ...]]] = [[] for _ in range(replicas)]
        self.chars = [0] * replicas  # tenant_to_char_count

    def match(self, replica: int, prompt: tuple[int, ...]) -> int:
        best = 0
        for seen in self.prompts[replica]:
            common = 0
            for a, b in zip(seen, prompt, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return best

    def insert(self, replica: int, prompt: tuple[int, ...]) -> None:
        self.chars[replica] += len(prompt) - self.match(replica, prompt)
        self.prompts[replica].append(prompt)


def ray_choices(tree: RayTree, prompt: tuple[int, ...], queues: Sequence[int]) -> set[int]:
    """ray prefix_aware_router.py ``_prefix_match_best_replicas`` at its defaults (imbalanced_threshold inf, match rate
    0.1), then request_router.py ``_select_from_candidate_replicas``: the shortest queue of the replicas with the
    longest match, or of the smallest tenants (the first in Ray's order, which is not the router's: any of them)."""
    matches = [tree.match(r, prompt) for r in range(len(queues))]
    longest = max(matches)
    if prompt and longest / len(prompt) >= 0.1:
        replicas = [r for r, m in enumerate(matches) if m == longest]
    else:
        replicas = [r for r, size in enumerate(tree.chars) if size == min(tree.chars)]
    shortest = min(queues[r] for r in replicas)
    return {r for r in replicas if queues[r] == shortest}


@st.composite
def block_prompts(draw: st.DrawFn, block_size: int) -> tuple[int, ...]:
    """A prompt of whole blocks from a few block contents, each starting with its own token: two prompts share a
    prefix of whole blocks only, so the router's whole-block match is Ray's token match."""
    blocks = draw(st.lists(st.integers(0, 3), max_size=20))
    return tuple(token for content in blocks for token in [content] * block_size)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 5), st.sampled_from([1, 4, 16]))
def test_ray_serve_follows_a_sequence_of_requests_as_ray_would(data: st.DataObject, replicas: int, size: int) -> None:
    policy = RayServePrefixAware()
    tree = RayTree(replicas)
    for _ in range(data.draw(st.integers(1, 25))):
        prompt = data.draw(block_prompts(size))
        queues = data.draw(st.lists(st.integers(0, 4), min_size=replicas, max_size=replicas))
        candidates = [
            Candidate(f"r{r}", tree.match(r, prompt), len(prompt), queues[r], block_size=size) for r in range(replicas)
        ]
        chosen = candidates.index(policy.choose(candidates))
        assert chosen in ray_choices(tree, prompt, queues)
        tree.insert(chosen, prompt)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(2, 4), st.sampled_from([4, 16]))
def test_ray_serve_tree_follows_repeated_prompts_of_any_length_as_ray_would(
    data: st.DataObject, replicas: int, size: int
) -> None:
    # A few prompts of any length (a partial last block too), each opening with its own token, drawn again and again:
    # a prompt either repeats one the tree holds (Ray's tree gains nothing) or shares nothing with the others. Their
    # lengths are close, so that a tail counted as growth would change which tree is the smallest.
    lengths = st.integers(size, 100) | st.sampled_from([3 * size + 1, 3 * size + size // 2, 4 * size - 1, 4 * size])
    pool = [(first,) * data.draw(lengths) for first in range(data.draw(st.integers(2, 5)))]
    policy = RayServePrefixAware()
    tree = RayTree(replicas)
    for _ in range(data.draw(st.integers(1, 25))):
        prompt = data.draw(st.sampled_from(pool))
        queues = data.draw(st.lists(st.integers(0, 1), min_size=replicas, max_size=replicas))
        candidates = [
            Candidate(f"r{r}", tree.match(r, prompt) // size * size, len(prompt), queues[r], block_size=size)
            for r in range(replicas)
        ]
        chosen = candidates.index(policy.choose(candidates))
        assert chosen in ray_choices(tree, prompt, queues)
        tree.insert(chosen, prompt)


def test_the_references_themselves_on_hand_worked_cases() -> None:
    # A reference that is wrong the same way as the baseline would pass every test above: pin a few by hand.
    request = Request(1000, 10)
    assert sglang_choices(request, [Worker(40, 0, 0, 0), Worker(0, 0, 0, 0)]) == ({0}, False)  # 0.4 > 0.3
    assert sglang_choices(request, [Worker(30, 5, 0, 0), Worker(0, 2, 0, 0)]) == ({1}, True)  # 0.3 is not above
    assert sglang_choices(request, [Worker(99, 100, 0, 0), Worker(0, 30, 0, 0)]) == ({1}, False)  # 70 > 64 > 45
    assert dynamo_logit(Request(480, 16), DynamoWorker(20, 160, 20, 5)) == (160 + 480) / 16 - 20 + 25 + 10
    pods = [Worker(90, 6, 0, 0), Worker(50, 1, 0, 0), *[Worker(0, 1, 0, 0)] * 3]  # mean 2, sigma 2.24: 6 > 4.24
    assert aibrix_choices(request, pods) == {1}
    tree = RayTree(2)
    tree.insert(0, (1, 1, 2, 2))
    assert ray_choices(tree, (1, 1, 3, 3), [5, 0]) == {0}  # half matched: the match, however long its queue
    assert ray_choices(tree, (3,), [0, 0]) == {1}  # no match: the smaller tree
    assert production_stack_choices([Worker(0, 9, 0, 0), Worker(0, 0, 0, 0)]) == {0, 1}  # no match: any
    assert production_stack_choices([Worker(3, 9, 0, 0), Worker(2, 0, 0, 0)]) == {0}  # the load plays no part
