"""The study's runs: every simulation (41 of them) and every profile figure the claims are judged on.

Nothing here knows what was published: it runs the simulator (the real Router, calibrated profiles, seed 0) and
returns the results, which :mod:`prefixroute.sim.study.claims` judges and :mod:`~prefixroute.sim.study.render`
writes out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

from prefixroute.policies import BoundedLoad, LoadPolicy
from prefixroute.router import Router
from prefixroute.sim.engine import Workload
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.profiles import load_profile
from prefixroute.sim.request import token_bytes
from prefixroute.sim.runner import SimSpec, backend_config, run_policy
from prefixroute.sim.workloads import SeedScenario

__all__ = ["HOT_MODES", "StudyRuns", "run_all"]

MODELS = ("llama-3-8b", "codellama-13b", "codellama-34b", "llama-2-70b")
PREFIX_LENGTHS = (2048, 4096, 8192, 16384)
SHARING_RATIOS = (0.1, 0.3, 0.5, 0.7, 0.9)
FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0)
PROMPT_LENGTHS = (2048, 4096, 8192, 16384)  # the hit/miss table
SWEEP_PREFIXES = 8  # the sweeps use 8 shared prefixes: a working set one engine's KV cache may or may not hold
HIT_TAIL_TOKENS = 100  # a hit leaves the prompt's last tokens to compute
HOT_MODES = MappingProxyType({
    "closed loop": SimSpec(scenario="hot-prefix"),
    "open loop 3 req/s": SimSpec(scenario="hot-prefix", users=None, rate=3.0),
})  # fmt: skip

Pair = tuple[PolicyResult, PolicyResult]  # (round-robin, bounded-load)


@dataclass
class StudyRuns:
    """Every result of one study, by section; ``all`` lists each simulation with its section, in run order."""

    requests: int
    seed: dict[str, PolicyResult] = field(default_factory=dict)  # by policy
    prefill_ms: dict[int, tuple[float, float]] = field(default_factory=dict)  # prompt tokens -> (miss, hit)
    decode_step_ms: float = 0.0  # 13B on a100-40gb: one step of 4 sequences with 5K tokens of context each
    lengths: dict[int, Pair] = field(default_factory=dict)
    models: dict[str, Pair] = field(default_factory=dict)
    kv_tokens: dict[str, int] = field(default_factory=dict)  # per engine, by model (a100-80gb)
    tp: dict[str, int] = field(default_factory=dict)
    kv_bytes_ratio_13b_8b: float = 0.0
    sharing: dict[float, Pair] = field(default_factory=dict)
    hot_affinity: dict[str, PolicyResult] = field(default_factory=dict)  # by mode
    hot_bounded: dict[str, dict[float, PolicyResult]] = field(default_factory=dict)  # by mode, then factor
    route_ms: float = 0.0  # median wall time of one route() of an 8K-token prompt over 8 backends
    all: list[tuple[str, PolicyResult]] = field(default_factory=list)


def run_all(requests: int, progress: Callable[[str], None]) -> StudyRuns:
    """Run every simulation of the study at ``requests`` requests each; O(41 simulations)."""
    runs = StudyRuns(requests=requests)

    def run(
        section: str,
        spec: SimSpec,
        policy: str | Callable[[], LoadPolicy],
        label: str,
        workload: Callable[[], Workload] | None = None,
    ) -> PolicyResult:
        progress(f"{section}: {label}")
        result = run_policy(spec.with_(requests=requests), policy, label=label, workload=workload)
        runs.all.append((section, result))
        return result

    for policy in ("round-robin", "prefix-affinity", "bounded-load"):
        runs.seed[policy] = run("8-GPU table", SimSpec(), policy, policy)
    profile = load_profile("codellama-13b", "a100-40gb")
    runs.decode_step_ms = 1000 * profile.step_seconds([], [5000] * 4)
    for length in PROMPT_LENGTHS:
        miss = 1000 * profile.prefill_seconds(length, 0)
        hit = 1000 * profile.prefill_seconds(HIT_TAIL_TOKENS, length - HIT_TAIL_TOKENS)
        runs.prefill_ms[length] = (miss, hit)
    big = SimSpec(gpu="a100-80gb")
    for length in PREFIX_LENGTHS:
        build = _seed_with(prefix_lengths=(length,) * SWEEP_PREFIXES)
        runs.lengths[length] = (
            run("prefix length", big, "round-robin", f"round-robin {length}", build),
            run("prefix length", big, "bounded-load", f"bounded-load {length}", build),
        )
    for model in MODELS:
        spec = SimSpec(model=model, gpu="a100-80gb")
        build = _seed_with(prefix_lengths=(8192,) * SWEEP_PREFIXES)
        runs.models[model] = (
            run("model size", spec, "round-robin", f"round-robin {model}", build),
            run("model size", spec, "bounded-load", f"bounded-load {model}", build),
        )
        model_profile = load_profile(model, "a100-80gb")
        runs.tp[model] = model_profile.tp
        config, _ = backend_config(spec)  # the engines' own capacity, sized with vLLM's defaults for that GPU
        runs.kv_tokens[model] = config.block_size * (config.capacity_blocks or 0)  # backend_config always sizes it
    runs.kv_bytes_ratio_13b_8b = (
        load_profile("codellama-13b", "a100-80gb").kv_bytes_per_token
        / load_profile("llama-3-8b", "a100-80gb").kv_bytes_per_token
    )
    for ratio in SHARING_RATIOS:
        build = _seed_with(sharing_ratio=ratio)
        runs.sharing[ratio] = (
            run("sharing ratio", SimSpec(), "round-robin", f"round-robin {ratio}", build),
            run("sharing ratio", SimSpec(), "bounded-load", f"bounded-load {ratio}", build),
        )
    for mode, spec in HOT_MODES.items():
        runs.hot_affinity[mode] = run("hot prefix", spec, "prefix-affinity", f"prefix-affinity ({mode})")
        runs.hot_bounded[mode] = {
            factor: run("hot prefix", spec, _bounded(factor), f"bounded-load {factor:g}× ({mode})")
            for factor in FACTORS
        }
    runs.route_ms = measure_route_ms()
    return runs


def measure_route_ms(
    *,
    tokens: int = 8192,
    backends: int = 8,
    repeats: int = 7,
    batch: int = 50,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median wall time in ms of one ``Router.route()`` of a ``tokens``-token prompt over ``backends`` backends.

    Routes ``repeats + 1`` batches of ``batch`` new prompts (no prefix in common) through one fresh Router, timing
    each batch on ``clock`` (seconds); the first batch warms up and is left out. O((repeats + 1) × batch routes).
    """
    router = Router()
    names = [f"gpu{i}" for i in range(backends)]
    prompts = [token_bytes(i * tokens, tokens) for i in range((repeats + 1) * batch)]
    timings = []
    for start in range(0, len(prompts), batch):
        began = clock()
        for prompt in prompts[start : start + batch]:
            router.route(prompt, names)
        timings.append((clock() - began) / batch)
    return 1000 * statistics.median(timings[1:])  # the first batch warms up


def _seed_with(
    prefix_lengths: tuple[int, ...] | None = None, sharing_ratio: float | None = None
) -> Callable[[], SeedScenario]:
    def build() -> SeedScenario:
        scenario = SeedScenario(seed=0, sharing_ratio=sharing_ratio)
        if prefix_lengths is not None:
            scenario.prefix_lengths = prefix_lengths
        return scenario

    return build


def _bounded(factor: float) -> Callable[[], LoadPolicy]:
    return lambda: BoundedLoad(factor=factor)
