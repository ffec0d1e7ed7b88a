"""finish(..., refused=True): a request the engine refused before computing anything leaves no predicted blocks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prefixroute import ConfigurationError, InvalidEventError, PrefixIndex, Router
from prefixroute.vllm import EventIndex

from ..conftest import FakeClock

BLOCK = 4


def tokens(first: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks whose tokens start at ``first`` (distinct firsts: distinct prompts)."""
    return list(range(first, first + blocks * BLOCK))


def idle(router: Router, backend: str) -> None:
    """Every counter of ``backend`` is back to 0 and the router's invariants hold."""
    candidate = router.decide([1], [backend]).candidates[0]
    assert (candidate.in_flight, candidate.pending_prefill_tokens, candidate.held_blocks) == (0, 0, 0)
    assert (candidate.active_blocks, candidate.in_prefill) == (0, 0)
    assert router.stats().in_flight == 0
    router._check()


def held(router: Router, prompt: Sequence[int], backend: str) -> int:
    return router.index.match(router.hasher.hash(prompt), [backend])[backend]


def test_a_refused_prompt_attracts_no_later_prompt_with_its_prefix() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 6)
    refused = router.route(prompt, ["gpu0", "gpu1", "gpu2"])
    router.start(refused)
    router.finish(refused, refused=True)
    assert held(router, prompt, refused.backend) == 0
    again = router.route(prompt + [7], ["gpu0", "gpu1", "gpu2"])
    assert (again.reason, again.matched_tokens) == ("miss", 0)
    idle(router, refused.backend)


def test_a_plain_finish_still_keeps_the_prediction() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 6)
    with router.track(router.route(prompt, ["gpu0", "gpu1"])) as decision:
        pass
    again = router.route(prompt + [7], ["gpu0", "gpu1"])
    assert (again.backend, again.reason, again.matched_tokens) == (decision.backend, "prefix", 6 * BLOCK)


def test_a_refused_prompt_longer_than_the_capacity_evicts_nothing() -> None:
    router = Router(block_size=BLOCK, capacity_blocks=64)
    kept = tokens(0, 8)
    with router.track(router.route(kept, ["gpu0"])):
        pass
    longest = router.route(tokens(10_000, 100), ["gpu0"])  # longer than the KV cache: the engine answers 400
    router.start(longest)
    router.finish(longest.id, refused=True)  # a bare id serves: the router kept the hashes
    assert held(router, kept, "gpu0") == 8
    assert router.index.blocks("gpu0") == 8
    idle(router, "gpu0")


def test_a_refused_long_prompt_leaves_room_for_the_next_instead_of_evicting_older_blocks() -> None:
    router = Router(block_size=BLOCK, capacity_blocks=64)
    kept = tokens(0, 8)
    with router.track(router.route(kept, ["gpu0"])):
        pass
    long = router.route(tokens(10_000, 40), ["gpu0"])  # fits the index, but the engine refused it
    router.start(long)
    router.finish(long, refused=True)
    with router.track(router.route(tokens(20_000, 20), ["gpu0"])):  # 8 + 20 blocks: nothing to evict
        pass
    assert held(router, kept, "gpu0") == 8
    assert router.index.blocks("gpu0") == 28
    idle(router, "gpu0")


def test_the_matched_prefix_and_blocks_a_request_in_flight_shares_stay() -> None:
    router = Router(block_size=BLOCK)
    system, shared, own = tokens(0, 4), tokens(100, 3), tokens(200, 5)
    with router.track(router.route(system, ["gpu0"])):
        pass
    refused = router.route(system + shared + own, ["gpu0"])
    assert refused.matched_tokens == 4 * BLOCK
    router.start(refused)
    other = router.route(system + shared + [9], ["gpu0"])  # matches what the refused one predicted
    assert other.matched_tokens == 7 * BLOCK
    router.start(other)
    unrelated = router.route(tokens(50_000, 3), ["gpu0"])
    router.start(unrelated)
    router.finish(refused, refused=True)
    hashes = router.hasher.hash(system + shared + own)
    assert held(router, system + shared + own, "gpu0") == 7
    assert not any(router.index.holds(h, "gpu0") for h in hashes[7:])
    assert held(router, tokens(50_000, 3), "gpu0") == 3
    router.finish(other)
    router.finish(unrelated)
    idle(router, "gpu0")


def test_a_request_in_flight_on_another_backend_keeps_nothing_of_a_refused_prompt() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 5)
    elsewhere = router.route(prompt, ["gpu1"])
    router.start(elsewhere)  # the same prompt in flight, but gpu1 computes it for itself, not for gpu0
    refused = router.route(prompt, ["gpu0"])
    router.start(refused)
    router.finish(refused, refused=True)
    assert router.index.blocks("gpu0") == 0 and held(router, prompt, "gpu1") == 5
    router.finish(elsewhere)
    idle(router, "gpu0")


def test_blocks_the_kv_events_confirm_stay() -> None:
    clock = FakeClock()
    router = Router(block_size=BLOCK, index=EventIndex(BLOCK, speculative_ttl=3.0, clock=clock))
    system, own = tokens(0, 3), tokens(100, 4)
    refused = router.route(system + own, ["gpu0"])
    assert refused.matched_tokens == 0
    router.start(refused)
    router.store("gpu0", router.hasher.hash(system))  # another request's prefill: the engine holds them now
    router.finish(refused, refused=True)
    assert router.index.match(router.hasher.hash(system + own), ["gpu0"]) == {"gpu0": 3}
    assert router.index.match_confirmed(router.hasher.hash(system), "gpu0") == 3
    index = router.index
    assert isinstance(index, EventIndex) and index.speculative_blocks("gpu0") == 0
    idle(router, "gpu0")


def test_a_refusal_is_idempotent_never_raises_and_retracts_only_once() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 5)
    first = router.route(prompt, ["gpu0"])
    router.start(first)
    router.finish(first, refused=True)
    second = router.route(prompt, ["gpu0"])  # sent again, accepted this time
    router.start(second)
    router.finish(first, refused=True)  # a repeat: ignored, and the second's prediction stays
    router.finish("no-such-request", refused=True)
    router.finish(object(), refused=True)  # type: ignore[arg-type]
    assert router.stats().ignored == 3
    assert held(router, prompt, "gpu0") == 5
    router.finish(second)
    idle(router, "gpu0")


def test_a_decision_never_committed_or_never_started_retracts_nothing() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 5)
    with router.track(router.route(prompt, ["gpu0"])):
        pass
    decided = router.decide(prompt + tokens(100, 2), ["gpu0"])  # never committed: it predicted nothing
    router.start(decided)
    router.finish(decided, refused=True)
    routed = router.route(prompt + tokens(100, 2), ["gpu0"])  # committed, never started
    router.finish(routed, refused=True)
    assert held(router, prompt + tokens(100, 2), "gpu0") == 7
    idle(router, "gpu0")


def test_a_commit_again_refreshes_recency_but_a_refusal_still_retracts_the_first_prediction() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 5)
    again = router.commit(router.route(prompt, ["gpu0"]))  # the backend now "holds" what the route predicted
    router.start(again)
    router.finish(again, refused=True)
    assert router.index.blocks("gpu0") == 0
    idle(router, "gpu0")


def test_a_commit_elsewhere_retracts_there() -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 5)
    decision = router.commit(router.decide(prompt, ["gpu0", "gpu1"]), "gpu1")
    router.start(decision)
    router.finish(decision, refused=True)
    assert router.index.blocks("gpu1") == 0
    idle(router, "gpu1")


def test_an_index_hook_that_raises_is_logged_not_raised() -> None:
    class Broken(PrefixIndex):
        def retract(self, hashes: Sequence[int], backend: str, start: int) -> None:
            raise RuntimeError("broken hook")

    router = Router(block_size=BLOCK, index=Broken(BLOCK))
    decision = router.route(tokens(0, 3), ["gpu0"])
    router.start(decision)
    router.finish(decision, refused=True)
    idle(router, "gpu0")


@pytest.mark.parametrize("refused", [1, "yes", None, 0.0])
def test_a_refused_that_is_not_a_bool_is_a_type_error_and_ends_nothing(refused: object) -> None:
    router = Router(block_size=BLOCK)
    decision = router.route(tokens(0, 5), ["gpu0"])
    router.start(decision)
    with pytest.raises(TypeError, match="True or False"):
        router.finish(decision, refused=refused)  # type: ignore[arg-type]
    assert router.in_flight("gpu0") == 1
    router.finish(decision)
    idle(router, "gpu0")


@pytest.mark.parametrize(
    ("hashes", "backend", "start", "error"),
    [
        ("abc", "gpu0", 0, TypeError),
        (None, "gpu0", 0, TypeError),
        ([1.5], "gpu0", 0, TypeError),
        ([2**70], "gpu0", 0, InvalidEventError),
        ([1], 5, 0, TypeError),
        ([1], "gpu0", "x", TypeError),
        ([1], "gpu0", True, TypeError),
        ([1], "gpu0", 3.5, TypeError),
        ([1], "gpu0", -1, ConfigurationError),
    ],
)
def test_retract_called_directly_checks_its_arguments_and_removes_nothing(
    hashes: object, backend: object, start: object, error: type[Exception]
) -> None:
    router = Router(block_size=BLOCK)
    prompt = tokens(0, 5)
    router.route(prompt, ["gpu0"])
    with pytest.raises(error):
        router.index.retract(hashes, backend, start)  # type: ignore[arg-type]
    router.index._check()
    assert held(router, prompt, "gpu0") == 5
