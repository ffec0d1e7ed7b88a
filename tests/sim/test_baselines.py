"""Each published baseline's decision rule, on candidates built by hand (the contract suite covers the rest)."""

from __future__ import annotations

import math
import random
import re

import pytest

from prefixroute import Candidate, ConfigurationError, InvalidTypeError, LoadPolicy, PowerOfTwo, policy_from_name
from prefixroute.sim.baselines import (
    BASELINES,
    AIBrixPrefixCache,
    DynamoKvRouter,
    LlmdDefaultProfile,
    ProductionStackPrefixAware,
    RayServePrefixAware,
    SGLangCacheAware,
)


def test_every_baseline_is_selectable_by_its_name_and_by_path() -> None:
    assert sorted(BASELINES) == ["aibrix", "dynamo", "llm-d", "production-stack", "ray-serve", "sglang"]
    for name, cls in BASELINES.items():
        assert cls.name == name and issubclass(cls, LoadPolicy)
        assert isinstance(policy_from_name(f"prefixroute.sim.baselines:{cls.__name__}"), cls)
        assert cls.__doc__ is not None and "Source:" in cls.__doc__


# -- SGLang cache_aware --------------------------------------------------------------------------------------------


def test_sglang_follows_a_match_above_the_cache_threshold_while_balanced() -> None:
    cached = Candidate("cached", 400, 1000, 10)  # match rate 0.4 > 0.3
    idle = Candidate("idle", 0, 1000, 0)
    assert SGLangCacheAware().choose([idle, cached]) is cached


def test_sglang_goes_to_the_least_loaded_below_the_cache_threshold() -> None:
    # sgl-model-gateway (sglang PR #14650) falls back to the minimum load, not the smallest tree.
    weak = [Candidate("a", 300, 1000, 5), Candidate("b", 0, 1000, 2)]  # rate exactly 0.3 is not above it
    assert SGLangCacheAware().choose(weak).backend == "b"
    misses = [Candidate("a", 0, 1000, 1), Candidate("b", 0, 1000, 1), Candidate("c", 0, 1000, 0)]
    policy = SGLangCacheAware()
    assert [policy.choose(misses).backend for _ in range(2)] == ["c", "c"]  # no tree rotation, load only
    # Equal loads: drawn at random (sglang PR #33138), from the seeded rng.
    assert {policy.choose(misses[:2]).backend for _ in range(40)} == {"a", "b"}
    draws = [SGLangCacheAware(seed=7).choose(misses[:2]).backend for _ in range(5)]
    assert len(set(draws)) == 1  # the same seed, the same draw
    # An empty prompt matches nothing: its match rate is not above the threshold, so the least loaded.
    assert SGLangCacheAware().choose([Candidate("a", 0, 0, 3), Candidate("b", 0, 0, 1)]).backend == "b"


def test_sglang_takes_the_first_least_loaded_when_imbalanced() -> None:
    hot, first, second = Candidate("hot", 1000, 1000, 100), Candidate("x", 0, 1000, 0), Candidate("y", 0, 1000, 0)
    assert {SGLangCacheAware(seed=s).choose([hot, first, second]).backend for s in range(20)} == {"x"}


def test_sglang_switches_to_shortest_queue_only_when_both_thresholds_are_crossed() -> None:
    hot = Candidate("hot", 1000, 1000, 100)
    # 100 - 30 = 70 > 64, but 100 > 1.5 * 30 = 45 as well: imbalanced, so the shortest queue.
    assert SGLangCacheAware().choose([hot, Candidate("cool", 0, 1000, 30)]).backend == "cool"
    # 100 - 70 = 30 is within the absolute threshold: balanced, so the match.
    assert SGLangCacheAware().choose([hot, Candidate("warm", 0, 1000, 70)]).backend == "hot"
    # With a relative threshold of 4, 100 > 4 * 30 fails: balanced.
    relaxed = SGLangCacheAware(balance_rel_threshold=4.0)
    assert relaxed.choose([hot, Candidate("cool", 0, 1000, 30)]).backend == "hot"
    # The relative threshold is router_args.py's 1.5: 130 - 60 = 70 > 64 and 130 > 1.5 x 60 (not 2.5 x 60).
    assert SGLangCacheAware().choose([hot._replace(in_flight=130), Candidate("cool", 0, 1000, 60)]).backend == "cool"
    # A threshold of 0 is a threshold: 2 - 1 > 0 and 2 > 1.5 x 1.
    strict = SGLangCacheAware(balance_abs_threshold=0)
    assert strict.choose([hot._replace(in_flight=2), Candidate("cool", 0, 1000, 1)]).backend == "cool"


# -- Dynamo KV router ----------------------------------------------------------------------------------------------


def test_dynamo_logit_is_prefill_blocks_plus_distinct_decode_blocks() -> None:
    candidate = Candidate("w", 320, 480, 2, pending_prefill_tokens=160, held_blocks=400, active_blocks=25)
    # prefill blocks (160 + 160) / 16 = 20; decode blocks 25 active + 30 request blocks - min(20 matched, 25) = 35.
    # held_blocks (every in-flight prompt counted whole) plays no part: Dynamo counts unique active blocks.
    assert DynamoKvRouter().logit(candidate) == 55.0
    assert DynamoKvRouter(overlap_score_weight=2.0).logit(candidate) == 75.0
    # Few active blocks: at most 5 of the request's blocks can be among them, so 25 are new: 20 + 5 + 25.
    assert DynamoKvRouter().logit(candidate._replace(active_blocks=5)) == 50.0
    # Nothing in flight: every one of the request's blocks is a new decode block, cached or not: 10 + 0 + 30.
    assert DynamoKvRouter().logit(candidate._replace(active_blocks=0, pending_prefill_tokens=0)) == 40.0
    # Only full blocks are decode blocks (isl // block_size); the partial one still counts as prefill.
    assert DynamoKvRouter().logit(Candidate("w", 0, 170, 0)) == pytest.approx(170 / 16 + 10)
    assert DynamoKvRouter().logit(Candidate("w", 0, 170, 0, block_size=32)) == pytest.approx(170 / 32 + 5)


def test_dynamo_credits_only_whole_overlap_blocks_against_prefill() -> None:
    # Dynamo's overlap is in blocks: new prefill tokens are isl - overlap_blocks x block_size, so a match that ends
    # mid-block credits only its full blocks, and a fully matched 170-token prompt still prefills its partial block.
    assert DynamoKvRouter().logit(Candidate("w", 100, 170, 0)) == pytest.approx((170 - 96) / 16 + 10)
    assert DynamoKvRouter().logit(Candidate("w", 170, 170, 0)) == pytest.approx((170 - 160) / 16 + 10)


def test_dynamo_counts_a_shared_prefix_in_flight_once() -> None:
    # "shared": ten requests in flight share one 10-block prompt (100 held, 10 distinct); "spread": 30 distinct.
    shared = Candidate("shared", 0, 160, 10, held_blocks=100, active_blocks=10)  # 10 + 10 + 10 = 30
    spread = Candidate("spread", 0, 160, 3, held_blocks=30, active_blocks=30)  # 10 + 30 + 10 = 50
    assert DynamoKvRouter().choose([spread, shared]) is shared


def test_dynamo_picks_the_lowest_logit_and_draws_among_equal_ones() -> None:
    cached = Candidate("cached", 480, 480, 1, active_blocks=30)  # 0 + 30 + 0 = 30
    busy_cold = Candidate("cold", 0, 480, 0, active_blocks=5)  # 30 + 5 + 30 = 65
    assert DynamoKvRouter().choose([busy_cold, cached]) is cached
    # ai-dynamo/dynamo lib/kv-router/src/scheduling/selector/default.rs (07a6c9ce) minimum_cost_index: reservoir
    # sampling over the rows at the lowest cost (random_index(tie_count) == 0 replaces the pick), so uniform among
    # them, with no tree-size step: whatever each worker has been routed before, from the seeded rng.
    tied = [Candidate("a", 0, 160, 0), Candidate("b", 0, 160, 0), Candidate("c", 0, 160, 1, active_blocks=1)]
    assert {DynamoKvRouter(seed=s).choose(tied).backend for s in range(40)} == {"a", "b"}
    assert [DynamoKvRouter(seed=3).choose(tied).backend for _ in range(5)] == [
        DynamoKvRouter(rng=random.Random(3)).choose(tied).backend for _ in range(5)
    ]


def test_dynamo_samples_by_softmax_above_temperature_zero() -> None:
    low = Candidate("low", 0, 160, 0)  # logit 20
    high = Candidate("high", 0, 160, 0, active_blocks=200)  # logit 220
    picks = [
        DynamoKvRouter(temperature=1.0, rng=random.Random(seed)).choose([low, high]).backend for seed in range(400)
    ]
    # Normalised logits 0 and 1: probabilities 1 / (1 + e^-1) = 0.73 and 0.27.
    assert 0.65 < picks.count("low") / len(picks) < 0.81
    with pytest.raises(ConfigurationError):
        DynamoKvRouter(temperature=-1.0)


def test_dynamo_softmax_scales_by_the_logit_range_and_the_temperature() -> None:
    def share_of_first(candidates: list[Candidate], temperature: float) -> float:
        picks = [
            DynamoKvRouter(temperature=temperature, rng=random.Random(seed)).choose(candidates) for seed in range(400)
        ]
        return picks.count(candidates[0]) / len(picks)

    low, high = Candidate("low", 0, 160, 0), Candidate("high", 0, 160, 0, active_blocks=200)  # logits 20 and 220
    # At temperature 0.5 the normalised logits 0 and 1 become 0 and 2: 1 / (1 + e^-2) = 0.88 (x 0.5 would be 0.62).
    assert 0.83 < share_of_first([low, high], 0.5) < 0.93
    # Normalised by max - min (100), not by the logits' size: 1020 and 1120 weigh as 20 and 120 do, 0.73.
    busy_low, busy_high = low._replace(active_blocks=1000), high._replace(active_blocks=1100)
    assert DynamoKvRouter().logit(busy_low) == 1020.0 and DynamoKvRouter().logit(busy_high) == 1120.0
    assert 0.65 < share_of_first([busy_low, busy_high], 1.0) < 0.81
    # Equal logits: uniform.
    assert 0.4 < share_of_first([low, low._replace(backend="twin")], 1.0) < 0.6


# -- llm-d default profile -----------------------------------------------------------------------------------------


def test_llmd_sums_prefix_queue_and_kv_scorers_with_weights_3_2_2() -> None:
    cached = Candidate("cached", 512, 1024, 0, queue_len=10, kv_usage=0.5)  # 3*0.5 + 2*0 + 2*0.5 = 2.5
    idle = Candidate("idle", 0, 1024, 0, queue_len=0, kv_usage=0.25)  # 0 + 2*1 + 2*0.75 = 3.5
    policy = LlmdDefaultProfile()
    assert policy.scores([cached, idle]) == [pytest.approx(2.5), pytest.approx(3.5)]
    assert policy.choose([cached, idle]) is idle
    full_match = cached._replace(matched_tokens=1024)  # 3 + 0 + 1 = 4
    assert policy.choose([full_match, idle]) is full_match


def test_llmd_prefix_score_counts_blocks_of_at_least_64_tokens_a_partial_one_included() -> None:
    policy = LlmdDefaultProfile()
    # GetBlockSize raises the engine's 16-token block to minBlockSizeTokens = 64: 300 tokens are 5 blocks (one
    # partial), and 192 matched tokens are 3 of them (at 16-token blocks it would be 12 of 19).
    assert policy.prefix_score(Candidate("a", 192, 300, 0)) == pytest.approx(3 / 5)
    assert policy.prefix_score(Candidate("a", 250, 300, 0)) == pytest.approx(3 / 5)  # 250 // 64 = 3 whole blocks
    # A router block above 64 tokens is used as it is.
    assert policy.prefix_score(Candidate("a", 256, 400, 0, block_size=128)) == pytest.approx(2 / 4)
    cached = Candidate("cached", 192, 300, 0, queue_len=4, kv_usage=0.45)  # 3*0.6 + 0 + 2*0.55 = 2.9
    idle = Candidate("idle", 0, 300, 0, queue_len=0, kv_usage=0.5)  # 0 + 2 + 1 = 3
    assert policy.choose([cached, idle]) is idle  # at 16-token blocks: 3*12/19 + 1.1 = 2.99, still idle
    assert policy.choose([cached._replace(matched_tokens=250), idle]) is idle  # 250 tokens: still 3 blocks of 64
    # At 16-token blocks 250 tokens would be 15 of 19 blocks: 3*15/19 + 1.1 = 3.47 > 3.


def test_llmd_prefix_score_caps_the_prompt_at_131072_tokens() -> None:
    policy = LlmdDefaultProfile()
    # defaultMaxPrefixTokens = 131072 caps the hashed blocks at 131072 // 64 = 2048, not 256: a 4096-token match of a
    # 16000-token prompt is 64 of 250 blocks, where a 256-block cap would count 64 of 256.
    assert policy.prefix_score(Candidate("a", 4096, 16000, 0)) == pytest.approx(64 / 250)
    # Past the cap only the first 2048 blocks are hashed: matching them all scores 1.
    assert policy.prefix_score(Candidate("a", 131072, 200000, 0)) == 1.0
    assert policy.prefix_score(Candidate("a", 65536, 200000, 0)) == pytest.approx(0.5)
    assert LlmdDefaultProfile(max_prefix_tokens=8192).prefix_score(Candidate("a", 8192, 16000, 0)) == 1.0
    # A block above 64 tokens that does not divide it: resolveMaxBlocks caps at 131072 // 100 = 1310 whole blocks.
    assert policy.prefix_score(Candidate("a", 65_500, 200_000, 0, block_size=100)) == pytest.approx(655 / 1310)
    # The least the options take is 1 token.
    assert LlmdDefaultProfile(max_prefix_tokens=1, min_block_tokens=1).prefix_score(Candidate("a", 0, 1, 0)) == 0.0
    # The cap is 131072 tokens exactly: with 1-token blocks, the first 131072 tokens of a 131073-token prompt are all
    # its hashed blocks (a cap one token higher would count 131072 of 131073).
    one_token_blocks = LlmdDefaultProfile(min_block_tokens=1)
    assert one_token_blocks.prefix_score(Candidate("a", 131072, 131073, 0, block_size=1)) == 1.0
    assert one_token_blocks.prefix_score(Candidate("a", 131071, 131073, 0, block_size=1)) == pytest.approx(
        131071 / 131072
    )
    for option, bad in (("max_prefix_tokens", 0), ("max_prefix_tokens", 2.5), ("min_block_tokens", 0)):
        with pytest.raises(ConfigurationError, match=f"{option} must be an int"):
            LlmdDefaultProfile(**{option: bad})  # type: ignore[arg-type]


def test_llmd_prefix_score_matches_the_partial_last_block_only_when_the_whole_prompt_is_cached() -> None:
    policy = LlmdDefaultProfile()
    # llm-d hashes the partial last block too, so an identical prompt matches all 7 of its 64-token blocks.
    assert policy.prefix_score(Candidate("a", 400, 400, 0)) == 1.0
    assert policy.prefix_score(Candidate("a", 399, 400, 0)) == pytest.approx(6 / 7)
    # A prompt shorter than one block is one partial block (getKVCacheBlocksFromTokens): 1 when identical, else 0.
    # Identical as far as the router can tell: all of its whole blocks are matched (48 of 50 tokens).
    assert policy.prefix_score(Candidate("a", 10, 10, 0)) == 1.0
    assert policy.prefix_score(Candidate("a", 48, 50, 0)) == 1.0
    assert policy.prefix_score(Candidate("a", 32, 50, 0)) == 0.0


def test_llmd_prefix_score_counts_an_identical_prompt_whole_though_the_router_sees_only_its_whole_blocks() -> None:
    policy = LlmdDefaultProfile()
    # The router hashes whole 16-token blocks only, so an identical earlier 300-token prompt shows as 288 matched
    # tokens, never 300. llm-d hashes the 44-token partial block too, and an identical prompt matches it: 5 of 5.
    assert policy.prefix_score(Candidate("a", 288, 300, 0)) == 1.0
    assert policy.prefix_score(Candidate("a", 272, 300, 0)) == pytest.approx(4 / 5)  # a whole block short
    # A 45-token prompt is one partial llm-d block: an identical one (32 of 32 visible tokens) matches it.
    assert policy.prefix_score(Candidate("a", 32, 45, 0)) == 1.0
    assert policy.prefix_score(Candidate("a", 16, 45, 0)) == 0.0
    # Under one router block nothing is visible: no match, whatever is cached (the same 0 for every backend).
    assert policy.prefix_score(Candidate("a", 0, 10, 0)) == 0.0
    repeat = Candidate("repeat", 288, 300, 0, queue_len=3, kv_usage=0.5)  # 3 + 0 + 1 = 4 (at 4 of 5 blocks: 3.4)
    idle = Candidate("idle", 0, 300, 0, queue_len=0, kv_usage=0.25)  # 0 + 2 + 1.5 = 3.5
    assert policy.choose([idle, repeat]) is repeat


def test_llmd_clamps_each_scorer_to_the_unit_range() -> None:
    # The scheduler profile clamps every scorer's value to [0, 1] (enforceScoreRange) before weighting it.
    over = Candidate("over", 0, 1000, 0, queue_len=0, kv_usage=1.5)
    assert LlmdDefaultProfile().scores([over]) == [pytest.approx(2.0)]  # 0 + 2 x 1 + 2 x max(0, 1 - 1.5)
    under = Candidate("under", 0, 1000, 0, queue_len=0, kv_usage=-0.5)
    assert LlmdDefaultProfile().scores([under]) == [pytest.approx(4.0)]  # 0 + 2 x 1 + 2 x min(1, 1 + 0.5)


def test_llmd_without_metrics_uses_the_router_accounting() -> None:
    # The queue is the requests without a first token (in_prefill), not every request in flight (decodes too).
    a = Candidate("a", 0, 1000, 4, held_blocks=10, active_blocks=90, capacity_blocks=100, in_prefill=3)  # q 0, kv 0.9
    b = Candidate("b", 0, 1000, 9, held_blocks=90, active_blocks=10, capacity_blocks=100, in_prefill=1)  # q 1, kv 0.1
    assert LlmdDefaultProfile().scores([a, b]) == [pytest.approx(0.2), pytest.approx(3.8)]
    # KV use is the memory held, distinct blocks (a shared prefix once), not every in-flight prompt summed.
    shared = Candidate("shared", 0, 1000, 3, held_blocks=90, active_blocks=10, capacity_blocks=100)
    spread = Candidate("spread", 0, 1000, 3, held_blocks=50, active_blocks=50, capacity_blocks=100)
    assert LlmdDefaultProfile().choose([spread, shared]) is shared
    equal = [Candidate("x", 0, 1000, 3), Candidate("y", 0, 1000, 3)]  # equal queues score 1, no capacity: kv 1
    assert LlmdDefaultProfile().scores(equal) == [4.0, 4.0]


def test_llmd_draws_among_equal_scores() -> None:
    # llm-d/llm-d-router ebab6879 pkg/epp/framework/plugins/scheduling/picker/maxscore/picker.go Pick: the endpoints
    # are shuffled (ShuffleScoredEndpoints) before a stable sort by score, so the highest scores tie at random.
    tied = [Candidate("a", 0, 1000, 3), Candidate("b", 0, 1000, 3), Candidate("c", 0, 1000, 5, in_prefill=2)]
    assert {LlmdDefaultProfile(seed=s).choose(tied).backend for s in range(40)} == {"a", "b"}
    assert [LlmdDefaultProfile(seed=3).choose(tied).backend for _ in range(5)] == [
        LlmdDefaultProfile(rng=random.Random(3)).choose(tied).backend for _ in range(5)
    ]


# -- AIBrix prefix-cache -------------------------------------------------------------------------------------------


def test_aibrix_takes_the_best_match_within_one_standard_deviation() -> None:
    counts = [Candidate("best", 900, 1000, 6), Candidate("good", 500, 1000, 1)]
    counts += [Candidate(f"c{i}", 0, 1000, 1) for i in range(3)]
    # counts 6, 1, 1, 1, 1: mean 2, sigma 2 -> "best" (6 > 4) is skipped for the next match, "good".
    assert AIBrixPrefixCache().choose(counts).backend == "good"
    calm = [c._replace(in_flight=1) if c.backend == "best" else c for c in counts]  # all 1: sigma 0
    assert AIBrixPrefixCache().choose(calm).backend == "best"


def test_aibrix_limit_uses_the_sample_standard_deviation() -> None:
    # counts 2, 0, 1: mean 1, sample sigma 1 -> "best" (2 <= 2) qualifies; a population sigma (0.82) would not.
    pods = [Candidate("best", 800, 1000, 2), Candidate("a", 0, 1000, 0), Candidate("b", 0, 1000, 1)]
    assert AIBrixPrefixCache().choose(pods).backend == "best"
    assert AIBrixPrefixCache().choose(pods[:1]).backend == "best"  # one pod: sigma 0, 2 <= 2


def test_aibrix_match_percentage_counts_full_blocks() -> None:
    # A 1620-token prompt has 101 full blocks: 82 matched blocks (1312 tokens) are 81 %, 81 (1296 tokens) 80 %.
    # By tokens both would be 80 % and the tie would go to the fewer requests; by blocks the deeper match wins.
    pods = [Candidate("fewer", 1296, 1620, 1), Candidate("deeper", 1312, 1620, 2)]
    assert AIBrixPrefixCache().choose(pods).backend == "deeper"
    # A match ending within a block counts its full blocks: 1311 tokens are 81 blocks, 80 % (not 81.9 blocks, 81 %).
    assert AIBrixPrefixCache().choose([pods[0]._replace(matched_tokens=1311), pods[1]]).backend == "deeper"
    # One matched block of 200 is 0 %, yet the pod is a matched pod and within mean + sigma (0.5 + 0.71).
    assert AIBrixPrefixCache().choose([Candidate("idle", 0, 3200, 0), Candidate("tiny", 16, 3200, 1)]).backend == (
        "tiny"
    )


def test_aibrix_when_imbalanced_matches_only_among_the_least_loaded() -> None:
    pods = [Candidate("hot", 1000, 1000, 20), Candidate("cold", 0, 1000, 5), Candidate("warm", 512, 1000, 5)]
    pods.append(Candidate("mid", 800, 1000, 11))
    # 20 - 5 = 15 > 8: only "cold" and "warm" (5 requests) are matched against; "warm" matches, so it wins.
    assert AIBrixPrefixCache().choose(pods).backend == "warm"
    # With no match among the least loaded: the fewest requests (one of them at random, as least_request.go draws).
    unmatched = [p._replace(matched_tokens=0) if p.backend == "warm" else p for p in pods]
    assert {AIBrixPrefixCache(seed=s).choose(unmatched).backend for s in range(40)} == {"cold", "warm"}


def test_aibrix_least_requests_when_nothing_matches_within_the_limit() -> None:
    hot = Candidate("hot", 1000, 1000, 11)
    # 11 - 3 = 8 is not above 8: balanced, and 11 is within mean 7 + sample sigma 5.66.
    assert AIBrixPrefixCache().choose([hot, Candidate("idle", 0, 1000, 3)]).backend == "hot"
    # 11 - 2 = 9 > 8: imbalanced, "hot" is not among the least loaded.
    assert AIBrixPrefixCache().choose([hot, Candidate("idle", 0, 1000, 2)]).backend == "idle"
    misses = [Candidate("a", 0, 1000, 2), Candidate("b", 0, 1000, 1)]
    assert AIBrixPrefixCache().choose(misses).backend == "b"
    # A count of 0 is a count: 2 - 1 > 0, so only "b" (the fewest) is matched against.
    assert AIBrixPrefixCache(imbalance_abs_count=0).choose([hot._replace(in_flight=2), misses[1]]).backend == "b"


def test_aibrix_draws_its_ties_at_random() -> None:
    # vllm-project/aibrix e3e10f9e, pkg/plugins/gateway/algorithms/least_request.go, the fallback
    # selectTargetPodWithLeastRequestCount: every pod at the fewest requests, then targetPods[rand.Intn(len)].
    misses = [Candidate("a", 0, 1000, 1), Candidate("b", 0, 1000, 3), Candidate("c", 0, 1000, 1)]
    assert {AIBrixPrefixCache(seed=s).choose(misses).backend for s in range(40)} == {"a", "c"}
    # The same when the matched pod is left out: 9 - 0 > 8 is imbalanced, and neither least-loaded pod matches.
    over = [Candidate("hot", 1000, 1000, 9), Candidate("x", 0, 1000, 0), Candidate("y", 0, 1000, 0)]
    assert {AIBrixPrefixCache(seed=s).choose(over).backend for s in range(40)} == {"x", "y"}
    # prefix_cache.go getTargetPodFromMatchedPods: rand.Shuffle, then a stable sort by (-match %, requests), so the
    # matched pods equal on both keys are drawn among at random.
    equal = [Candidate("p", 512, 1000, 2), Candidate("q", 256, 1000, 1), Candidate("r", 512, 1000, 2)]
    assert {AIBrixPrefixCache(seed=s).choose(equal).backend for s in range(40)} == {"p", "r"}
    # Seeded: the same seed, the same draws; an rng is taken too.
    assert [AIBrixPrefixCache(seed=3).choose(equal).backend for _ in range(5)] == [
        AIBrixPrefixCache(rng=random.Random(3)).choose(equal).backend for _ in range(5)
    ]


# -- Ray Serve PrefixCacheAffinityRouter ---------------------------------------------------------------------------


def test_ray_serve_follows_a_match_rate_of_at_least_ten_percent_to_the_shortest_queue_among_the_best() -> None:
    a = Candidate("a", 100, 1000, 5)
    b = Candidate("b", 100, 1000, 3)
    c = Candidate("c", 0, 1000, 0)
    assert RayServePrefixAware().choose([a, b, c]).backend == "b"  # rate 0.1 qualifies; b has the shorter queue
    below = [a._replace(matched_tokens=99), c]  # 0.099 < 0.1: smallest tree (both empty), shortest queue
    assert RayServePrefixAware().choose(below).backend == "c"


def test_ray_serve_falls_back_to_power_of_two_when_imbalanced() -> None:
    # The threshold of 10 is Ray's former default (ray PR #59390 made it inf); set here, as a deployment would.
    hot = Candidate("hot", 1000, 1000, 20)
    others = [Candidate(f"c{i}", 0, 1000, 5) for i in range(3)]  # 20 - 5 = 15 > 10
    picks = {RayServePrefixAware(imbalanced_threshold=10, seed=s).choose([hot, *others]).backend for s in range(30)}
    assert "hot" not in picks and len(picks) > 1
    # Only above the threshold: queues 15 and 5 differ by exactly 10, so the longest match still wins.
    cold = Candidate("cold", 0, 1000, 5)
    at_threshold = [hot._replace(in_flight=15), cold]
    assert {RayServePrefixAware(imbalanced_threshold=10, seed=s).choose(at_threshold).backend for s in range(20)} == {
        "hot"
    }
    # At 0 any difference is imbalanced: power of two choices over both replicas, the shorter queue.
    assert {RayServePrefixAware(imbalanced_threshold=0, seed=s).choose(at_threshold).backend for s in range(20)} == {
        "cold"
    }


def test_ray_serve_never_falls_back_to_power_of_two_at_its_default_threshold() -> None:
    # ray main's prefix_aware_router.py initialize_state: imbalanced_threshold defaults to float("inf") (PR #59390),
    # so the longest match wins however uneven the queues.
    hot = Candidate("hot", 1000, 1000, 500)
    others = [Candidate(f"c{i}", 0, 1000, 0) for i in range(3)]
    assert {RayServePrefixAware(seed=s).choose([hot, *others]).backend for s in range(30)} == {"hot"}
    assert RayServePrefixAware().imbalanced_threshold == math.inf
    with pytest.raises(ConfigurationError, match="imbalanced_threshold"):
        RayServePrefixAware(imbalanced_threshold=-math.inf)


def test_ray_serve_power_of_two_breaks_a_tie_by_the_first_replica_drawn() -> None:
    # pow_2_router.py draws random.sample(..., k=2) and _select_from_candidate_replicas keeps the first of equal
    # queues in that order: a tie goes to the first drawn, not to the lower placement index.
    pods = [Candidate("hot", 1000, 1000, 20), *(Candidate(f"c{i}", 0, 1000, 5) for i in range(3))]
    for seed in range(40):
        first, second = random.Random(seed).sample(range(len(pods)), 2)
        expected = min(pods[first], pods[second], key=lambda c: c.in_flight)
        assert RayServePrefixAware(imbalanced_threshold=10, seed=seed).choose(pods) is expected


def test_ray_serve_an_empty_prompt_has_match_rate_zero() -> None:
    # match_rate = matched / len(text) if text else 0.0: at a threshold of 0 an empty prompt takes the longest-match
    # branch (every replica, the shortest queue), not the smallest tree.
    policy = RayServePrefixAware(match_rate_threshold=0.0)
    assert policy.choose([Candidate("a", 0, 100, 0), Candidate("b", 0, 100, 0)]).backend == "a"  # a's tree: 100
    assert policy.choose([Candidate("a", 0, 0, 0), Candidate("b", 0, 0, 1)]).backend == "a"


def test_ray_serve_tree_gains_nothing_from_a_prompt_it_holds_though_the_router_sees_only_its_whole_blocks() -> None:
    # Ray's tree gains only characters it lacks. The router sees a repeated 170-token prompt as 160 matched tokens
    # (its whole 16-token blocks): the 10-token tail is in the tree already and must not count as growth.
    policy = RayServePrefixAware()
    assert policy.choose([Candidate("a", 0, 170, 0), Candidate("b", 0, 170, 0)]).backend == "a"  # trees: a 170
    assert policy.choose([Candidate("a", 0, 175, 0), Candidate("b", 0, 175, 0)]).backend == "b"  # smaller: b 175
    assert policy.choose([Candidate("a", 160, 170, 0), Candidate("b", 0, 170, 0)]).backend == "a"  # the repeat
    # A miss goes to the smaller tree: a's 170 (Ray), not b's 175 (with the tail counted again, a would be 180).
    assert policy.choose([Candidate("a", 0, 300, 0), Candidate("b", 0, 300, 0)]).backend == "a"


def test_ray_serve_tree_grows_by_a_new_prompt_shorter_than_one_block() -> None:
    # The router sees no block of a 10-token prompt, so nothing of it matched: Ray's tree gains its 10 characters.
    policy = RayServePrefixAware()
    assert policy.choose([Candidate("a", 0, 10, 0), Candidate("b", 0, 10, 0)]).backend == "a"  # a's tree: 10
    assert policy.choose([Candidate("a", 0, 300, 0), Candidate("b", 0, 300, 0)]).backend == "b"  # the smaller tree


def test_ray_serve_tree_refuses_a_growth_that_is_not_a_count() -> None:
    # A hand-built candidate that matches more than its prompt (under one block, where no whole block shows) would
    # shrink its tree, and a float prompt would leave a float size there: both are named instead of recorded.
    policy = RayServePrefixAware()
    with pytest.raises(ConfigurationError, match=r"^Candidate 'b': matched_tokens \(12\) must be at most prompt"):
        policy.choose([Candidate("b", 12, 10, 0)])
    with pytest.raises(InvalidTypeError, match=r"^Candidate 'b': prompt_tokens must be an int, not 10\.0$"):
        policy.choose([Candidate("b", 0, 10.0, 0)])  # type: ignore[arg-type]
    # b's tree is still empty, as a's is: a miss goes to the first of them, then to the other.
    assert [policy.choose([Candidate(b, 0, 10, 0) for b in "ab"]).backend for _ in range(2)] == ["a", "b"]


# -- production-stack prefixaware ----------------------------------------------------------------------------------


def test_production_stack_picks_at_random_among_the_longest_matches_whatever_the_load() -> None:
    a = Candidate("a", 512, 1000, 50)
    b = Candidate("b", 512, 1000, 40)
    c = Candidate("c", 0, 1000, 0)
    picks = {ProductionStackPrefixAware(seed=s).choose([a, b, c]).backend for s in range(30)}
    assert picks == {"a", "b"}
    misses = [c, c._replace(backend="d")]
    assert {ProductionStackPrefixAware(seed=s).choose(misses).backend for s in range(30)} == {"c", "d"}


@pytest.mark.parametrize(
    ("cls", "option"),
    [
        (SGLangCacheAware, "cache_threshold"),
        (SGLangCacheAware, "balance_abs_threshold"),
        (SGLangCacheAware, "balance_rel_threshold"),
        (DynamoKvRouter, "overlap_score_weight"),
        (DynamoKvRouter, "temperature"),
        (LlmdDefaultProfile, "prefix_weight"),
        (LlmdDefaultProfile, "queue_weight"),
        (LlmdDefaultProfile, "kv_weight"),
        (AIBrixPrefixCache, "imbalance_abs_count"),
        (AIBrixPrefixCache, "standard_deviation_factor"),
        (RayServePrefixAware, "imbalanced_threshold"),
        (RayServePrefixAware, "match_rate_threshold"),
    ],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, True, "1", None])
def test_baseline_options_are_checked_when_given(cls: type, option: str, bad: object) -> None:
    if (cls, option, bad) == (RayServePrefixAware, "imbalanced_threshold", math.inf):
        assert cls(**{option: bad}).imbalanced_threshold == math.inf  # Ray's default: never imbalanced
        return
    # The message opens with the option's own name and ends with the value given.
    with pytest.raises(ConfigurationError, match=rf"^{option} must be .*, not {re.escape(repr(bad))}$"):
        cls(**{option: bad})


RANDOMISED = list(BASELINES.values())  # each draws at random where its original does, ties at least: all six


@pytest.mark.parametrize("cls", RANDOMISED)
@pytest.mark.parametrize("rng", [5, "x", random, object()])
def test_a_baseline_refuses_an_rng_of_the_wrong_type_as_the_core_does(cls: type, rng: object) -> None:
    """Was: a ConfigurationError (a ValueError), where the core's policies raise InvalidTypeError for it."""
    with pytest.raises(InvalidTypeError, match="rng must be a random.Random") as core:
        PowerOfTwo(rng=rng)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match=f"{cls.__name__} rng must be a random.Random, not ") as baseline:
        cls(rng=rng)
    assert str(baseline.value).split(" ", 1)[1] == str(core.value).split(" ", 1)[1]  # the same words after the name


@pytest.mark.parametrize("cls", RANDOMISED)
def test_a_baseline_takes_every_seed_the_core_takes(cls: type) -> None:
    """Was: a str seed holding a lone surrogate raised a bare UnicodeEncodeError (the core seeds from its bytes)."""
    seeds: list[object] = ["\ud800", "model-a", b"\xff", 2**80, None]
    for seed in seeds:
        PowerOfTwo(seed=seed)  # type: ignore[arg-type]  # str and bytes seeds are taken, as random.Random's
        cls(seed=seed)
    with pytest.raises(InvalidTypeError, match=f"{cls.__name__} seed must be an int, str, bytes or None"):
        cls(seed=1.5)
