"""Route a small realistic workload and print where each request went and why.

Three chat applications share a fleet of four vLLM backends. Each has its own long system prompt; users send short
questions, some in multi-turn conversations whose every turn extends the previous context. The router sends each
prompt to the backend that already holds its prefix, and spreads load when one prefix gets hot.

Run: ``python examples/quickstart.py``
"""

from __future__ import annotations

import random
from collections import Counter

from prefixroute import BoundedLoad, Router

BACKENDS = ["http://gpu0:8000", "http://gpu1:8000", "http://gpu2:8000", "http://gpu3:8000"]


def tokens(rng: random.Random, count: int) -> list[int]:
    """Stand-in token ids (a real gateway tokenizes the prompt with the model's tokenizer)."""
    return [rng.randrange(32_000) for _ in range(count)]


def main() -> None:
    rng = random.Random(7)
    router = Router(block_size=16, policy=BoundedLoad(factor=2.0))
    system_prompts = {"support-bot": tokens(rng, 1200), "sql-assistant": tokens(rng, 2400), "coder": tokens(rng, 800)}
    conversations: dict[int, list[int]] = {}
    in_flight = []
    reasons: Counter[str] = Counter()
    matched = prompt_total = 0

    print(f"{'#':>3}  {'app':<14} {'prompt':>6} {'cached':>6}  {'backend':<18} reason")
    for request in range(24):
        app = rng.choices(list(system_prompts), weights=[6, 3, 1])[0]
        if request % 4 == 3 and conversations:  # a follow-up turn: the previous context plus a new question
            conversation = rng.choice(list(conversations))
            prompt = conversations[conversation] + tokens(rng, rng.randrange(20, 80))
        else:
            conversation = request
            prompt = system_prompts[app] + tokens(rng, rng.randrange(20, 200))
        conversations[conversation] = prompt

        decision = router.route(prompt, BACKENDS)
        router.start(decision)  # a gateway calls finish() when the response ends; here some stay open
        in_flight.append(decision)
        if len(in_flight) > 6:
            router.finish(in_flight.pop(0))

        reasons[decision.reason] += 1
        matched += decision.matched_tokens
        prompt_total += decision.prompt_tokens
        print(
            f"{request:>3}  {app:<14} {decision.prompt_tokens:>6} {decision.matched_tokens:>6}  "
            f"{decision.backend:<18} {decision.reason}"
        )

    print(f"\npredicted prefix-cache hit rate: {matched / prompt_total:.1%} of prompt tokens")
    print("reasons:", ", ".join(f"{reason} {count}" for reason, count in reasons.most_common()))
    print("in flight now:", {backend: router.in_flight(backend) for backend in BACKENDS})


if __name__ == "__main__":
    main()
