"""Synthetic workloads by name: ``seed``, ``hot-prefix``, ``shared-prefix``, ``multi-turn``, ``rag``, ``system-prompt``.

Every scenario is a :class:`~prefixroute.sim.engine.Workload`: ``next_request(user)`` draws the user's next request
from one seeded ``random.Random``. Prompts are token-id runs: each shared piece (a system prompt, a document) has
its own fixed run of ids, and every unique piece (a user's question) gets fresh ids, so two prompts share a prefix
exactly when the scenario says they do. ``sharing_ratio`` is the fraction of requests that use the scenario's
shared material; the rest get an all-unique prompt of similar length. The choices are documented, with reasons,
in ``docs/simulator.md``.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Mapping
from types import MappingProxyType

from prefixroute._numbers import as_float, as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.request import SimRequest, token_bytes

__all__ = ["SCENARIOS", "Scenario", "make_workload", "scenario_names"]

_SHARED_SPAN = 2**19  # token ids per shared piece: piece k owns [k * 2**19, (k + 1) * 2**19)
_SHARED_PIECES = 2**11  # pieces 0..2047 stay below the unique range
_UNIQUE_BASE = 2**30  # unique pieces are cut, in order, from [2**30, 2**31)
_UNIQUE_SPAN = 2**30


class Scenario:
    """Base of the synthetic workloads: shared pieces, fresh unique tokens, one seeded rng.

    Subclasses implement :meth:`shared_request` (a request that uses the shared material). ``think_time`` is
    the scenario's default mean think time for closed-loop users (seconds).
    """

    name = ""
    think_time = 0.0
    default_sharing_ratio = 1.0

    def __init__(self, *, seed: int = 0, sharing_ratio: float | None = None) -> None:
        given = self.default_sharing_ratio if sharing_ratio is None else sharing_ratio
        ratio = as_float(given)
        if ratio is None or not 0.0 <= ratio <= 1.0:
            raise ConfigurationError(f"sharing ratio must be a number between 0 and 1, not {shown(given)}")
        seed_int = as_int(seed)
        if seed_int is None:
            raise InvalidTypeError(f"seed must be an int, not {type(seed).__name__}")
        self.sharing_ratio = ratio
        self.rng = random.Random(seed_int)
        self._next_unique = 0
        self._pieces: dict[int, bytes] = {}

    def piece(self, key: int, length: int) -> bytes:
        """The shared piece number ``key``: always the same ``length`` tokens (cached per key).

        Raises:
            ConfigurationError: ``key`` is not an int in [0, 2048) or ``length`` not one in [1, 2**19].
        """
        number, count = as_int(key), as_int(length)
        if number is None or count is None or not 0 <= number < _SHARED_PIECES or not 0 < count <= _SHARED_SPAN:
            raise ConfigurationError(
                f"a shared piece is an int key in [0, {_SHARED_PIECES}) of an int length in [1, {_SHARED_SPAN}] "
                f"tokens, not key {shown(key)} of length {shown(length)}"
            )
        key, length = number, count
        data = self._pieces.get(key)
        if data is None or len(data) != 4 * length:
            data = self._pieces[key] = token_bytes(key * _SHARED_SPAN, length)
        return data

    def unique(self, length: int) -> bytes:
        """``length`` token ids no other piece uses (wrapping after 2**30 tokens).

        Raises:
            ConfigurationError: ``length`` is not an int in [1, 2**30].
        """
        count = as_int(length)
        if count is None or not 0 < count <= _UNIQUE_SPAN:
            raise ConfigurationError(
                f"a unique piece is an int length in [1, {_UNIQUE_SPAN}] tokens, not {shown(length)}"
            )
        length = count
        if self._next_unique + length > _UNIQUE_SPAN:
            self._next_unique = 0
        start = _UNIQUE_BASE + self._next_unique
        self._next_unique += length
        return token_bytes(start, length)

    def next_request(self, user: int) -> SimRequest | None:
        """Draw the next request: shared with probability ``sharing_ratio``, else all unique."""
        request = self.shared_request(user)
        if self.rng.random() < self.sharing_ratio:
            return request
        return SimRequest(self.unique(request.prompt_tokens), request.output_tokens, tag="unique")

    def shared_request(self, user: int) -> SimRequest:
        """A request that uses the scenario's shared material."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sharing_ratio={self.sharing_ratio})"


class SeedScenario(Scenario):
    """The published 8-GPU benchmark: four shared prefixes of 2K/4K/6K/8K tokens, a unique question, ~100 tokens out.

    90 % of requests (``sharing_ratio``) start with one of the prefixes, chosen uniformly; each adds a unique
    100–400-token question. Outputs are uniform in 80–120 tokens. Users send back to back (no think time), as a
    load generator's concurrent clients do.
    """

    name = "seed"
    default_sharing_ratio = 0.9
    prefix_lengths: tuple[int, ...] = (2048, 4096, 6144, 8192)

    def shared_request(self, user: int) -> SimRequest:
        rng = self.rng
        which = rng.randrange(len(self.prefix_lengths))
        prompt = self.piece(which, self.prefix_lengths[which]) + self.unique(rng.randint(100, 400))
        return SimRequest(prompt, rng.randint(80, 120), tag=f"prefix{which}")


class HotPrefixScenario(Scenario):
    """One hot system prompt: 80 % of traffic starts with it, the rest with one of 8 other system prompts.

    All system prompts are 4K tokens; each request adds a unique 100–400-token question and generates 80–120 tokens.
    """

    name = "hot-prefix"
    hot_fraction = 0.8
    others = 8
    prefix_tokens = 4096

    def shared_request(self, user: int) -> SimRequest:
        rng = self.rng
        which = 0 if rng.random() < self.hot_fraction else 1 + rng.randrange(self.others)
        prompt = self.piece(which, self.prefix_tokens) + self.unique(rng.randint(100, 400))
        return SimRequest(prompt, rng.randint(80, 120), tag="hot" if which == 0 else f"prefix{which}")


class SharedPrefixScenario(Scenario):
    """Groups of prompts sharing a system prompt, as SGLang's ``generated-shared-prefix`` benchmark makes them.

    64 groups × 16 questions per group; a 2048-token system prompt per group, 128-token questions, 256 output
    tokens. A request picks a group and one of its questions uniformly, so whole prompts recur.
    """

    name = "shared-prefix"
    groups = 64
    prompts_per_group = 16
    system_tokens = 2048
    question_tokens = 128
    output_tokens = 256

    def shared_request(self, user: int) -> SimRequest:
        rng = self.rng
        group = rng.randrange(self.groups)
        question = rng.randrange(self.prompts_per_group)
        prompt = self.piece(group, self.system_tokens) + self.piece(
            self.groups + group * self.prompts_per_group + question, self.question_tokens
        )
        return SimRequest(prompt, self.output_tokens, tag=f"group{group}")


class MultiTurnScenario(Scenario):
    """Chat sessions: every turn's prompt is the previous prompt, its answer, and a new user message.

    A session has 2–8 turns (uniform); it opens with a shared 1024-token system prompt; user messages are 50–300
    tokens, answers 100–300 tokens, and the answer's token ids are part of the request, so the simulated vLLM
    caches them as it does real output. Users think 2 s (mean) between turns. ``user`` picks the session: closed-
    loop users each run their own sessions one after another.
    """

    name = "multi-turn"
    think_time = 2.0
    system_tokens = 1024

    def __init__(self, *, seed: int = 0, sharing_ratio: float | None = None) -> None:
        super().__init__(seed=seed, sharing_ratio=sharing_ratio)
        self._sessions: dict[int, tuple[bytes, int]] = {}  # user -> (context so far, turns left)

    def next_request(self, user: int) -> SimRequest | None:
        rng = self.rng
        context, turns_left = self._sessions.get(user, (b"", 0))
        if turns_left == 0:
            shared = rng.random() < self.sharing_ratio
            system = self.piece(0, self.system_tokens) if shared else self.unique(self.system_tokens)
            context, turns_left = system, rng.randint(2, 8)
        prompt = context + self.unique(rng.randint(50, 300))
        output_tokens = rng.randint(100, 300)
        output = self.unique(output_tokens)
        self._sessions[user] = (prompt + output, turns_left - 1)
        return SimRequest(prompt, output_tokens, output=output, tag=f"session{user}")


class SystemPromptScenario(MultiTurnScenario):
    """Chats behind one long system prompt: every conversation opens with the same 4,096 tokens, then its turns.

    The shape of an assistant or agent deployment, whose instructions and tool definitions lead every request: one
    4,096-token system prompt shared by all users (by ``sharing_ratio`` of the sessions; all by default), then
    conversations as in ``multi-turn`` (2–8 turns, 50–300-token user messages, 100–300-token answers that the next
    turn carries, 2 s mean think time). Every prompt shares its first 256 blocks with every other, so a policy that
    follows the longest match alone sends all traffic to one backend; what should decide is where each
    conversation's own history lives and how busy each backend is.
    """

    name = "system-prompt"
    system_tokens = 4096


class RagScenario(Scenario):
    """Retrieval-augmented prompts: a shared 512-token instruction, three retrieved documents, a question.

    Documents (200, 1024 tokens each) are drawn by Zipf popularity (exponent 1.1), the most relevant first, so
    requests whose top document agrees share instruction + that document (vLLM reuses only a leading run).
    Questions are 50–150 tokens; answers 150 tokens.
    """

    name = "rag"
    documents = 200
    document_tokens = 1024
    per_prompt = 3
    zipf_exponent = 1.1
    instruction_tokens = 512

    def __init__(self, *, seed: int = 0, sharing_ratio: float | None = None) -> None:
        super().__init__(seed=seed, sharing_ratio=sharing_ratio)
        weights = [1.0 / (rank**self.zipf_exponent) for rank in range(1, self.documents + 1)]
        self._cumulative = list(itertools.accumulate(weights))

    def _document(self) -> int:
        total = self._cumulative[-1]
        return bisect.bisect_left(self._cumulative, self.rng.random() * total)

    def shared_request(self, user: int) -> SimRequest:
        chosen: list[int] = []
        while len(chosen) < self.per_prompt:
            doc = self._document()
            if doc not in chosen:
                chosen.append(doc)
        parts = [self.piece(0, self.instruction_tokens)]
        parts += [self.piece(1 + doc, self.document_tokens) for doc in chosen]
        parts.append(self.unique(self.rng.randint(50, 150)))
        return SimRequest(b"".join(parts), 150, tag=f"doc{chosen[0]}")


SCENARIOS: Mapping[str, Callable[..., Scenario]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            SeedScenario,
            HotPrefixScenario,
            SharedPrefixScenario,
            MultiTurnScenario,
            RagScenario,
            SystemPromptScenario,
        )
    }
)
"""Scenario classes by name (read-only)."""


def scenario_names() -> list[str]:
    """The scenario names ``--scenario`` accepts."""
    return list(SCENARIOS)


def make_workload(name: str, *, seed: int = 0, sharing_ratio: float | None = None) -> Scenario:
    """Build scenario ``name`` with its own rng seeded by ``seed``.

    Raises:
        ConfigurationError: an unknown name, or ``sharing_ratio`` not a number in [0, 1].
        TypeError: ``name`` is not a str, or ``seed`` not an int.
    """
    if not isinstance(name, str):
        raise InvalidTypeError(f"a scenario name is a str, not {type(name).__name__}")
    try:
        factory = SCENARIOS[name]
    except KeyError:
        raise ConfigurationError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}") from None
    return factory(seed=seed, sharing_ratio=sharing_ratio)
