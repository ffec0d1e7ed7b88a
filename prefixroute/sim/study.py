"""``prefixroute study``: rerun every published claim in the simulator and write ``docs/study.md`` with plots.

Each section runs the simulator (the real Router, calibrated profiles, seed 0) and sets the simulated figure beside
the published one. Verdicts are computed from the figures, never written in advance; nothing here tunes the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from prefixroute.errors import ConfigurationError
from prefixroute.policies import BoundedLoad, LoadPolicy
from prefixroute.sim.engine import Workload
from prefixroute.sim.metrics import PolicyResult
from prefixroute.sim.profiles import load_profile
from prefixroute.sim.report import write_plot, write_sweep_plot
from prefixroute.sim.runner import SimSpec, run_policy
from prefixroute.sim.workloads import SeedScenario

__all__ = ["run_study"]

# The reported 8× A100 CodeLlama-13B figures (DESIGN.md): KV hit rate, P99 TTFT in ms, requests/s.
PUBLISHED = MappingProxyType({"round-robin": (0.125, 6800.0, 36.3), "prefix-aware": (0.975, 1000.0, 44.4)})
MODELS = ("llama-3-8b", "codellama-13b", "codellama-34b", "llama-2-70b")
PREFIX_LENGTHS = (2048, 4096, 8192, 16384)
SHARING_RATIOS = (0.1, 0.3, 0.5, 0.7, 0.9)
FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0)
SWEEP_PREFIXES = 8  # the sweeps use 8 shared prefixes: a working set one engine's KV cache may or may not hold


@dataclass
class _Study:
    requests: int
    progress: Callable[[str], None]
    runs: list[tuple[str, PolicyResult]]

    def run(
        self,
        section: str,
        spec: SimSpec,
        policy: str | Callable[[], LoadPolicy],
        *,
        label: str | None = None,
        workload: Callable[[], Workload] | None = None,
    ) -> PolicyResult:
        name = label or (policy if isinstance(policy, str) else "policy")
        self.progress(f"{section}: {name}")
        result = run_policy(spec.with_(requests=self.requests), policy, label=name, workload=workload)
        self.runs.append((section, result))
        return result


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _ms(x: float) -> str:
    return f"{x:,.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b and not math.isnan(a) and not math.isnan(b) else "–"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _seed_with(
    prefix_lengths: tuple[int, ...] | None = None, sharing_ratio: float | None = None
) -> Callable[[], SeedScenario]:
    def build() -> SeedScenario:
        scenario = SeedScenario(seed=0, sharing_ratio=sharing_ratio)
        if prefix_lengths is not None:
            scenario.prefix_lengths = prefix_lengths
        return scenario

    return build


def _section_table(study: _Study, out: Path) -> list[str]:
    spec = SimSpec()
    results = [study.run("8-GPU table", spec, p) for p in ("round-robin", "prefix-affinity", "bounded-load")]
    write_plot(out / "study-seed.png", results, title="seed · codellama-13b@a100-40gb × 8")
    rr, pa, bl = results
    decode_ms = 1000 * load_profile("codellama-13b", "a100-40gb").step_seconds([], [5000] * 4)
    (rr_hit, rr_p99, rr_rps), (pa_hit, pa_p99, pa_rps) = PUBLISHED["round-robin"], PUBLISHED["prefix-aware"]
    rows = [
        [r.policy, _pct(hit), _pct(r.hit_rate), _ms(p99), _ms(r.ttft_ms["p99"]), f"{rps}", f"{r.throughput_rps:.2f}"]
        for r, (hit, p99, rps) in (
            (rr, PUBLISHED["round-robin"]),
            (pa, PUBLISHED["prefix-aware"]),
            (bl, PUBLISHED["prefix-aware"]),
        )
    ]
    ratio_rows = [
        [
            "P99 TTFT, prefix-aware / round-robin",
            _ratio(pa_p99, rr_p99),
            _ratio(pa.ttft_ms["p99"], rr.ttft_ms["p99"]),
            _ratio(bl.ttft_ms["p99"], rr.ttft_ms["p99"]),
        ],
        [
            "throughput, prefix-aware / round-robin",
            _ratio(pa_rps, rr_rps),
            _ratio(pa.throughput_rps, rr.throughput_rps),
            _ratio(bl.throughput_rps, rr.throughput_rps),
        ],
        [
            "KV hit rate gain (points)",
            f"{100 * (pa_hit - rr_hit):+.1f}",
            f"{100 * (pa.hit_rate - rr.hit_rate):+.1f}",
            f"{100 * (bl.hit_rate - rr.hit_rate):+.1f}",
        ],
    ]
    return [
        "## 1. The 8-GPU table",
        "",
        "`prefixroute simulate` (scenario `seed`: 8 × codellama-13b on a100-40gb, 30 closed-loop users, 1,500 "
        'requests). Published "prefix-aware" is compared with both prefix-affinity and bounded-load.',
        "",
        _table(
            [
                "routing",
                "published hit",
                "simulated KV hit",
                "published P99 ms",
                "simulated P99 ms",
                "published req/s",
                "simulated req/s",
            ],
            rows,
        ),
        "",
        _table(["ratio", "published", "prefix-affinity", "bounded-load"], ratio_rows),
        "",
        "![seed TTFT CDF and per-backend load](study-seed.png)",
        "",
        f"Absolute throughput differs by an order of magnitude: in the calibrated model one 13B decode step of 4 "
        f"requests with 5K tokens of context each takes {decode_ms:.0f} ms, so 30 users each generating ~100 "
        "tokens after a 2K–8K-token prompt cannot reach 36 req/s on 8 GPUs (the published figures imply ~0.8 s "
        'per request). The published hit rate counts "same backend as the last request with that prefix"; KV '
        f"residency under round-robin is {_pct(rr.hit_rate)}, so the gain is smaller than 85 points.",
        "",
    ]


def _section_hit_miss() -> list[str]:
    profile = load_profile("codellama-13b", "a100-40gb")
    rows = []
    figures = {}
    for length in (2048, 4096, 8192, 16384):
        miss = 1000 * profile.prefill_seconds(length, 0)
        hit = 1000 * profile.prefill_seconds(100, length - 100)
        figures[length] = (miss, hit)
        rows.append([f"{length:,}", _ms(miss), _ms(hit), _ratio(hit, miss)])
    return [
        "## 2. Cost of a hit and of a miss, and the prefix-length claim",
        "",
        "Published: a 13B hit costs ~18 ms of TTFT against ~500 ms for a miss; 8K tokens: miss 638 / hit 448 ms; "
        "16K: 817 / 461 ms. The profile's prefill time for codellama-13b on one a100-40gb, alone (no queueing), "
        "where a hit leaves the last 100 tokens to compute:",
        "",
        _table(["prompt tokens", "miss ms", "hit ms", "hit / miss"], rows),
        "",
        f"At 8K tokens the model gives miss {figures[8192][0]:,.0f} / hit {figures[8192][1]:,.0f} ms (published "
        f"638 / 448); at 16K, {figures[16384][0]:,.0f} / {figures[16384][1]:,.0f} ms (published 817 / 461). The "
        "published hits cost 70 % and 56 % of a miss, which a full prefix hit cannot (only the uncached tail is "
        "computed); they look like partial hits or include queueing. The model's miss grows faster than linearly "
        "with length because attention over the prompt grows quadratically.",
        "",
    ]


def _section_prefix_length(study: _Study) -> tuple[list[str], list[tuple[int, PolicyResult, PolicyResult]]]:
    spec = SimSpec(gpu="a100-80gb")
    sweep = []
    rows = []
    for length in PREFIX_LENGTHS:
        build = _seed_with(prefix_lengths=(length,) * SWEEP_PREFIXES)
        rr = study.run("prefix length", spec, "round-robin", workload=build, label=f"round-robin {length}")
        bl = study.run("prefix length", spec, "bounded-load", workload=build, label=f"bounded-load {length}")
        sweep.append((length, rr, bl))
        rows.append(
            [
                f"{length:,}",
                _pct(rr.hit_rate),
                _pct(bl.hit_rate),
                _ms(rr.ttft_ms["p50"]),
                _ms(bl.ttft_ms["p50"]),
                _ratio(bl.ttft_ms["p99"], rr.ttft_ms["p99"]),
                _ratio(bl.throughput_rps, rr.throughput_rps),
            ]
        )
    return [
        "## 3. Prefix length sweep",
        "",
        f"`seed` with {SWEEP_PREFIXES} shared prefixes of the given length (90 % of requests on one of them), "
        "codellama-13b on a100-80gb (a 40 GB card cannot hold a 16K prompt; an 80 GB one holds ~60K tokens of KV), "
        "round-robin (RR) against bounded-load (BL). Published: the gain grows with prefix length.",
        "",
        _table(
            ["prefix tokens", "RR hit", "BL hit", "RR TTFT p50 ms", "BL TTFT p50 ms", "BL/RR p99 TTFT", "BL/RR req/s"],
            rows,
        ),
        "",
        _verdict_growth("prefix length", [(f"{n:,} tokens", rr, bl) for n, rr, bl in sweep]),
        "",
    ], sweep


def _verdict_growth(what: str, sweep: Sequence[tuple[str, PolicyResult, PolicyResult]]) -> str:
    gains = [(name, rr.ttft_ms["p50"] - bl.ttft_ms["p50"], bl.hit_rate - rr.hit_rate) for name, rr, bl in sweep]
    described = "; ".join(f"{name}: {100 * hit:+.1f} points, p50 TTFT {-ms:+,.0f} ms" for name, ms, hit in gains)
    grows = all(b[1] >= a[1] for a, b in zip(gains, gains[1:], strict=False))
    return f"Bounded-load against round-robin by {what}: {described}. The p50 TTFT gain " + (
        "grows monotonically along the sweep, as published."
        if grows
        else "does not grow monotonically along the sweep."
    )


def _section_models(study: _Study) -> tuple[list[str], list[tuple[str, PolicyResult, PolicyResult]]]:
    sweep = []
    rows = []
    for model in MODELS:
        spec = SimSpec(model=model, gpu="a100-80gb")
        build = _seed_with(prefix_lengths=(8192,) * SWEEP_PREFIXES)
        rr = study.run("model size", spec, "round-robin", workload=build, label=f"round-robin {model}")
        bl = study.run("model size", spec, "bounded-load", workload=build, label=f"bounded-load {model}")
        profile = load_profile(model, "a100-80gb")
        tp = profile.tp
        kv_tokens = 16 * profile.kv_capacity_blocks(16, max_num_batched_tokens=8192, max_num_seqs=1024)
        sweep.append((model, rr, bl))
        rows.append(
            [
                f"{model} (tp{tp})",
                f"{kv_tokens / 1000:,.0f}K",
                _pct(rr.hit_rate),
                _pct(bl.hit_rate),
                _ms(rr.ttft_ms["p99"]),
                _ms(bl.ttft_ms["p99"]),
                _ratio(bl.ttft_ms["p99"], rr.ttft_ms["p99"]),
                _ratio(bl.throughput_rps, rr.throughput_rps),
            ]
        )
    kv_ratio = (
        load_profile("codellama-13b", "a100-80gb").kv_bytes_per_token
        / load_profile("llama-3-8b", "a100-80gb").kv_bytes_per_token
    )
    return [
        "## 4. Model size sweep",
        "",
        f"`seed` with {SWEEP_PREFIXES} shared prefixes of 8K tokens, on 8 engines of each model on a100-80gb (70B: "
        "two GPUs per engine). Published: 13B–70B benefit most; under 8B the routing overhead can cancel the gain.",
        "",
        _table(
            [
                "model",
                "KV tokens per engine",
                "RR hit",
                "BL hit",
                "RR p99 ms",
                "BL p99 ms",
                "BL/RR p99 TTFT",
                "BL/RR req/s",
            ],
            rows,
        ),
        "",
        _verdict_growth("model", [(m, rr, bl) for m, rr, bl in sweep]),
        f"Llama-3-8B's grouped-query attention makes its KV {kv_ratio:.1f}× smaller per token than CodeLlama-13B's, "
        "so each "
        "engine caches the whole working set and round-robin loses little: in this model the small model gains "
        "less because its cache is large, not because of routing overhead.",
        "",
        "The simulator does not charge for routing itself; `benchmarks/bench_route.py` measures `route()` at "
        "~0.2 ms for an 8K-token prompt (see Performance), far below any TTFT difference above, so in this model "
        "routing overhead does not cancel the gain for an 8B model.",
        "",
    ], sweep


def _section_sharing(study: _Study) -> tuple[list[str], list[tuple[float, PolicyResult, PolicyResult]]]:
    spec = SimSpec()
    sweep = []
    rows = []
    for ratio in SHARING_RATIOS:
        build = _seed_with(sharing_ratio=ratio)
        rr = study.run("sharing ratio", spec, "round-robin", workload=build, label=f"round-robin {ratio}")
        bl = study.run("sharing ratio", spec, "bounded-load", workload=build, label=f"bounded-load {ratio}")
        sweep.append((ratio, rr, bl))
        rows.append(
            [
                f"{100 * ratio:.0f} %",
                _pct(rr.hit_rate),
                _pct(bl.hit_rate),
                _pct(bl.tag_hit_rate()),
                _ratio(bl.ttft_ms["p99"], rr.ttft_ms["p99"]),
                _ratio(bl.throughput_rps, rr.throughput_rps),
            ]
        )
    half = next(bl for ratio, _rr, bl in sweep if ratio == 0.5)
    return [
        "## 5. Sharing-ratio sweep",
        "",
        "`seed` with `--sharing-ratio` from 10 % to 90 % (the rest all-unique prompts). Published: at 50 % sharing "
        'prefix-aware routing still reaches 91 % hits. "BL hit, shared" counts only requests on a shared prefix.',
        "",
        _table(["sharing", "RR hit", "BL hit", "BL hit, shared", "BL/RR p99 TTFT", "BL/RR req/s"], rows),
        "",
        f"At 50 % sharing bounded-load's KV hit rate is {_pct(half.hit_rate)} overall and {_pct(half.tag_hit_rate())} "
        "on the shared-prefix requests (published: 91 %). KV residency cannot exceed the shared share of prompt "
        "tokens, so the published 91 % can only be a hit rate among shared-prefix requests, or a routing "
        '("same backend") rate.',
        "",
    ], sweep


def _section_hot(study: _Study) -> tuple[list[str], list[tuple[str, float, PolicyResult]]]:
    lines = [
        "## 6. Hot prefix, with and without the load fallback",
        "",
        "`hot-prefix` (80 % of traffic on one 4K-token system prompt). Published: pure affinity puts that 80 % on "
        "one GPU; the 2× fallback costs ~5 points of hit rate and improves P95 by 36 % and P99 by 45 %. Closed loop "
        "(30 users) and open loop (Poisson, 3 req/s):",
        "",
    ]
    points: list[tuple[str, float, PolicyResult]] = []
    for mode, spec in (
        ("closed loop", SimSpec(scenario="hot-prefix")),
        ("open loop 3 req/s", SimSpec(scenario="hot-prefix", users=None, rate=3.0)),
    ):
        pa = study.run("hot prefix", spec, "prefix-affinity", label=f"prefix-affinity ({mode})")
        rows = [
            [
                "prefix-affinity",
                _pct(pa.hit_rate),
                _ms(pa.ttft_ms["p95"]),
                _ms(pa.ttft_ms["p99"]),
                f"{100 * pa.max_backend_share:.0f} %",
                "",
                "",
            ]
        ]
        for factor in FACTORS:
            r = study.run("hot prefix", spec, _bounded(factor), label=f"bounded-load {factor:g}× ({mode})")
            points.append((mode, factor, r))
            rows.append(
                [
                    f"bounded-load {factor:g}×",
                    _pct(r.hit_rate),
                    _ms(r.ttft_ms["p95"]),
                    _ms(r.ttft_ms["p99"]),
                    f"{100 * r.max_backend_share:.0f} %",
                    f"{100 * (1 - r.ttft_ms['p95'] / pa.ttft_ms['p95']):+.0f} %",
                    f"{100 * (1 - r.ttft_ms['p99'] / pa.ttft_ms['p99']):+.0f} %",
                ]
            )
        two = next(r for m, f, r in points if m == mode and f == 2.0)
        met = (
            pa.hit_rate - two.hit_rate <= 0.10
            and two.ttft_ms["p95"] <= 0.64 * pa.ttft_ms["p95"]
            and two.ttft_ms["p99"] <= 0.55 * pa.ttft_ms["p99"]
        )
        lines += [
            f"**{mode}**",
            "",
            _table(["policy", "KV hit", "P95 ms", "P99 ms", "max share", "P95 improvement", "P99 improvement"], rows),
            "",
            f"The 2× fallback against pure affinity, {mode}: {100 * (two.hit_rate - pa.hit_rate):+.1f} points of hit "
            f"rate (published about −5), P95 {100 * (1 - two.ttft_ms['p95'] / pa.ttft_ms['p95']):+.0f} % and P99 "
            f"{100 * (1 - two.ttft_ms['p99'] / pa.ttft_ms['p99']):+.0f} % better (published +36 % and +45 %): "
            + ("reproduced or exceeded." if met else "not reproduced."),
            "",
        ]
    lines += [
        "Closed-loop users cannot overload the hot GPU: each waits for its answer, so the hot GPU runs a large "
        "batch that shares one cached prefix and the others idle; throughput drops instead of latency rising. "
        "Open-loop arrivals keep coming, and the hot GPU's queue grows without bound under pure affinity.",
        "",
    ]
    return lines, points


def _section_rule(study: _Study) -> list[str]:
    rows = []
    above = []
    for section, r in study.runs:
        ratio = r.ttft_ms["p99"] / r.ttft_ms["p50"] if r.ttft_ms["p50"] else math.nan
        rows.append((section, r.policy, r.hit_rate, ratio))
        above.append(ratio > 5)
    high = [r for r, a in zip(rows, above, strict=True) if a]
    low = [r for r, a in zip(rows, above, strict=True) if not a]
    return [
        "## 7. The P99/P50 > 5 rule",
        "",
        "Published: a P99/P50 TTFT ratio above 5 hints at cache misses under load. Over every run in this study:",
        "",
        _table(
            ["runs", "count", "mean KV hit rate"],
            [
                ["P99/P50 > 5", str(len(high)), _pct(_mean([h for _, _, h, _ in high]))],
                ["P99/P50 ≤ 5", str(len(low)), _pct(_mean([h for _, _, h, _ in low]))],
            ],
        ),
        "",
        (
            "Runs above 5 had the *higher* mean hit rate here, so the rule is not supported as stated. "
            if _mean([h for _, _, h, _ in high]) >= _mean([h for _, _, h, _ in low])
            else "Runs above 5 had the lower mean hit rate, consistent with the rule. "
        )
        + "In this model a high ratio mostly marks *queueing for KV memory* (a few large prompts waiting behind "
        "others), which low hit rates cause but which also appears with high hit rates when affinity concentrates "
        "load; treat the rule as a hint to look at hit rate and queue length together, not as a diagnosis.",
        "",
    ]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _bounded(factor: float) -> Callable[[], LoadPolicy]:
    return lambda: BoundedLoad(factor)


def _section_dollars(study: _Study) -> list[str]:
    seed_runs = [r for s, r in study.runs if s == "8-GPU table"]
    rows = []
    for r in seed_runs:
        per_million = 8 * 2.0 / (r.throughput_rps * 3600) * 1e6
        rows.append(
            [
                r.policy,
                f"{r.throughput_rps:.2f}",
                f"${per_million:,.0f}",
                f"{r.recompute_gpu_seconds:,.0f}",
                f"${r.recompute_usd_per_month:,.0f}",
            ]
        )
    return [
        "## 8. Dollars per month",
        "",
        "`seed` at $2 per GPU-hour: what a million requests cost on the 8-GPU fleet at each policy's throughput, "
        "and the GPU time spent prefilling prefixes another GPU held at the time, scaled to a 30-day month of the "
        "same traffic.",
        "",
        _table(["policy", "req/s", "$ per million requests", "recompute GPU-s in run", "recompute $/month"], rows),
        "",
    ]


def run_study(out: Path, *, requests: int = 1500, progress: Callable[[str], None] = lambda _m: None) -> Path:
    """Run every section and write ``out/study.md`` plus its PNGs; return the Markdown path."""
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ConfigurationError(f"--requests must be a positive int, not {requests!r}")
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"--output {out} is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    study = _Study(requests=requests, progress=progress, runs=[])
    lines = [
        "# Study: the published claims, rerun in the simulator",
        "",
        f"Generated by `prefixroute study` (seed 0, {requests:,} requests per run); do not edit by hand. Every figure "
        "comes from the simulator in [Simulator](simulator.md): the real Router, vLLM-like engines, the calibrated "
        "[cost model](cost-model.md). Hit rates are KV residency (cached prompt tokens / prompt tokens), not the "
        'published "same backend as last time" figure. Where the simulation disagrees with a published number '
        "this page says so; the model was not tuned toward any of them.",
        "",
    ]
    lines += _section_table(study, out)
    lines += _section_hit_miss()
    length_lines, lengths = _section_prefix_length(study)
    model_lines, models = _section_models(study)
    sharing_lines, sharing = _section_sharing(study)
    hot_lines, hot = _section_hot(study)
    lines += length_lines + model_lines + sharing_lines + hot_lines
    write_sweep_plot(out / "study-sweeps.png", models, lengths, sharing, hot)
    lines += ["![sweeps](study-sweeps.png)", ""]
    lines += _section_rule(study)
    lines += _section_dollars(study)
    path = out / "study.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
