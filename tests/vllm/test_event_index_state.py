"""A state machine over every EventIndex operation: its confirmed part must follow a plain PrefixIndex driven with
the same event writes, whatever predictions, refusals and clock moves come between, with _check() after each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixroute import BlockHasher, PrefixIndex
from prefixroute.vllm import EventIndex

from ..conftest import FakeClock

BACKENDS = ["a", "b"]
TTL = 3.0
CHAINS = [BlockHasher(1).hash(list(range(start, start + 8))) for start in (0, 100, 200)]
CAPACITIES = st.none() | st.integers(0, 12)


class EventIndexMachine(RuleBasedStateMachine):
    """Event writes (stores from block 0 and continuations, removals, capacities, a backend removed, clear), routing
    predictions (of prompts the backend keeps, and of longer ones, which are not recorded) and refusals (retract), and
    time passing, in any order.

    The model: ``reference``, a plain PrefixIndex that gets exactly the event writes. The confirmed part
    (match_confirmed, blocks, hashes) must equal it; match() may add unexpired speculation on top, never less; a
    prediction must be matched whole until TTL has passed (unless a removal or refusal took a block of it); once
    2 x TTL pass without one, match() is the confirmed match alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.index = EventIndex(1, speculative_ttl=TTL, clock=self.clock)
        self.reference = PrefixIndex(1)
        self.quiet_since = self.clock.now  # the clock reading of the last prediction
        # (backend, chain, length) -> when predicted, for predictions nothing has removed a block of since
        self.trusted: dict[tuple[str, tuple[int, ...], int], float] = {}
        self.capacity: dict[str, int | None] = dict.fromkeys(BACKENDS)

    def forget(self, backend: str, chain: list[int] | None = None, start: int = 0) -> None:
        """Stop expecting the predictions whose blocks from ``start`` on were just removed."""
        for key in [k for k in self.trusted if k[0] == backend and (chain is None or k[1] == tuple(chain))]:
            if key[2] > start:
                del self.trusted[key]

    @rule(backend=st.sampled_from(BACKENDS), chain=st.sampled_from(CHAINS), cut=st.integers(0, 6))
    def store(self, backend: str, chain: list[int], cut: int) -> None:
        parent = chain[cut - 1] if cut else None
        self.index.insert(chain[cut:], backend, parent=parent)
        self.reference.insert(chain[cut:], backend, parent=parent)

    @rule(backend=st.sampled_from(BACKENDS), chain=st.sampled_from(CHAINS), start=st.integers(0, 7))
    def remove(self, backend: str, chain: list[int], start: int) -> None:
        self.index.remove(iter(chain[start:]), backend)
        self.reference.remove(chain[start:], backend)
        self.forget(backend, chain, start)

    @rule(backend=st.sampled_from(BACKENDS), capacity=CAPACITIES)
    def set_capacity(self, backend: str, capacity: int | None) -> None:
        self.index.set_capacity(backend, capacity)
        self.reference.set_capacity(backend, capacity)
        self.capacity[backend] = capacity

    @rule(backend=st.sampled_from(BACKENDS))
    def remove_backend(self, backend: str) -> None:
        self.index.remove_backend(backend)
        self.reference.remove_backend(backend)
        self.forget(backend)

    @rule()
    def clear(self) -> None:
        self.index.clear()
        self.reference.clear()
        self.trusted.clear()

    @rule(backend=st.sampled_from(BACKENDS), chain=st.sampled_from(CHAINS), length=st.integers(1, 8))
    def predict(self, backend: str, chain: list[int], length: int) -> None:
        prompt = chain[:length]
        before = self.index.match(prompt, [backend])[backend]
        self.index.predict(prompt, backend, 0)
        capacity = self.capacity[backend]
        if capacity is not None and length > capacity:  # more blocks than the backend keeps: its engine refuses it
            assert self.index.match(prompt, [backend])[backend] == before
            return
        self.quiet_since = self.clock.now
        self.trusted[backend, tuple(chain), length] = self.clock.now
        assert self.index.match(prompt, [backend])[backend] == length  # trusted right away, whole

    @rule(backend=st.sampled_from(BACKENDS), chain=st.sampled_from(CHAINS), start=st.integers(0, 8))
    def retract(self, backend: str, chain: list[int], start: int) -> None:
        self.index.retract(chain, backend, start)  # speculation only: the confirmed part stays
        self.forget(backend, chain, start)

    @rule(seconds=st.sampled_from([0.5, 1.0, 1.5, TTL, 2 * TTL]))
    def time_passes(self, seconds: float) -> None:
        self.clock.tick(seconds)

    @invariant()
    def confirmed_part_is_what_the_events_wrote(self) -> None:
        self.index._check(chains=CHAINS)
        self.reference._check(chains=CHAINS)
        for backend in BACKENDS:
            assert self.index.hashes(backend) == self.reference.hashes(backend), backend
            assert self.index.blocks(backend) == self.reference.blocks(backend), backend
        quiet = self.clock.now - self.quiet_since >= 2 * TTL
        for chain in CHAINS:
            confirmed = self.reference.match(chain, BACKENDS)
            matched = self.index.match(chain, BACKENDS)
            for backend in BACKENDS:
                assert self.index.match_confirmed(chain, backend) == confirmed[backend], backend
                assert matched[backend] >= confirmed[backend], backend
                if quiet:
                    assert matched[backend] == confirmed[backend], backend
        for (backend, predicted, length), made in self.trusted.items():
            if self.clock.now - made < TTL:  # trusted whole for at least TTL, across a turn of the generations
                assert self.index.match(predicted, [backend])[backend] >= length, (backend, length)


EventIndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_event_index_state_machine = EventIndexMachine.TestCase
