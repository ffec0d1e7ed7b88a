"""Every scenario end to end with the real profiles: invariants checked after every step, same seed same result."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from prefixroute.errors import ConfigurationError, InvalidTypeError, NoBackendError, PrefixRouteError
from prefixroute.policies import BoundedLoad, Candidate, LoadPolicy, RoundRobin
from prefixroute.sim.profiles import load_profile
from prefixroute.sim.runner import SimSpec, backend_config, build_policy, run_policy, vllm_defaults
from prefixroute.sim.traces import load_trace
from prefixroute.sim.workloads import make_workload, scenario_names


@pytest.mark.parametrize("scenario", scenario_names())
def test_scenarios_run_checked_and_reproducibly(scenario: str) -> None:
    spec = SimSpec(scenario=scenario, requests=80, users=10, think_time=0.1)
    first = run_policy(spec, "bounded-load", check=True)
    second = run_policy(spec, "bounded-load", check=True)
    assert first.to_json() == second.to_json()
    assert first.requests + first.rejected == 80
    assert 0.0 <= first.hit_rate <= 1.0 and first.ttft_ms["p50"] > 0


def test_open_loop_multi_turn_continues_sessions() -> None:
    spec = SimSpec(scenario="multi-turn", requests=200, users=4, rate=2.0)
    result = run_policy(spec, "prefix-affinity")
    assert result.requests == 200
    assert sorted(result.tag_tokens) == [f"session{user}" for user in range(4)]  # arrivals take turns among 4 users
    assert result.hit_rate > 0.3  # turns after the first reuse their session's earlier prompt and answer


def test_events_mode_predicts_what_the_engines_hold() -> None:
    spec = SimSpec(requests=200, users=8, index_source="events")
    result = run_policy(spec, "prefix-affinity", check=True)
    assert abs(result.predicted_hit_rate - result.hit_rate) < 0.05


def test_gateway_replicas_each_build_their_own_policy_and_share_nothing() -> None:
    built: list[LoadPolicy] = []

    def policy() -> LoadPolicy:
        built.append(build_policy("round-robin", seed=0))
        return built[-1]

    spec = SimSpec(requests=90, users=9, gateways=3)
    first = run_policy(spec, policy, check=True)
    assert len(built) == 3 and len({id(p) for p in built}) == 3  # a stateful policy is each replica's own
    assert first.requests == 90
    assert run_policy(spec, policy).to_json() == first.to_json()  # same seed, same result
    for bad in (0, 257, 1.5, "2"):
        with pytest.raises(ConfigurationError, match=r"^--gateways must be an int in \[1, 256\]"):
            SimSpec(gateways=bad)  # type: ignore[arg-type]


def test_configuration_errors_are_raised_when_the_spec_is_made() -> None:
    with pytest.raises(ConfigurationError, match="--index-source"):
        SimSpec(requests=5, index_source="gossip")
    with pytest.raises(ConfigurationError, match="first_token must be True or False"):
        SimSpec(requests=5, first_token="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="--users or --rate"):
        SimSpec(requests=5, users=None)
    for field, value in [
        ("backends", 0),
        ("backends", True),
        ("rate", float("nan")),
        ("rate", float("inf")),
        ("speedup", -1.0),
        ("think_time", float("nan")),
        ("sharing_ratio", 1.5),
        ("gpu_memory_utilization", 0.0),
        ("capacity_blocks", 0),
        ("max_num_seqs", -1),
        ("metrics_interval", 0.0),
        ("seed", 1.5),
        ("scenario", "nope"),
    ]:
        with pytest.raises(ConfigurationError):
            SimSpec(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="never stop"):
        SimSpec(rate=2.0, users=None, requests=None)
    for slow in (
        {"requests": None, "users": None, "rate": 1e-6, "duration": 1e7},  # ran for about a day
        {"requests": 3, "users": 1, "think_time": 1e7},
    ):
        with pytest.raises(ConfigurationError, match="over 100,000,000 polls"):
            SimSpec(metrics_interval=0.001, **slow)
    with pytest.raises(ConfigurationError, match="closed-loop users of a scenario never stop"):
        SimSpec(users=5, requests=None)  # ran forever
    for trace in (5, b"mooncake:t.jsonl"):
        with pytest.raises(ConfigurationError, match="--trace must be FORMAT:PATH, a str"):
            SimSpec(trace=trace)  # type: ignore[arg-type]


def test_none_is_refused_where_the_field_has_no_none_and_profiles_are_checked_when_the_spec_is_made() -> None:
    # These fields were taken as None and failed only when the spec ran (gateways with a bare TypeError).
    for field, message in [
        ("gateways", "--gateways must be an int in [1, 256], not None"),
        ("backends", "--backends must be an int in [1, 4,096], not None"),
        ("speedup", "--speedup must be a finite number > 0, not None"),
        ("gpu_hour_usd", "--gpu-hour-usd must be a finite number >= 0, not None"),
        ("model", "--model must be a profile's name, a str, not NoneType"),
        ("gpu", "--gpu must be a profile's name, a str, not NoneType"),
    ]:
        with pytest.raises(ConfigurationError) as refused:
            SimSpec(**{field: None})  # type: ignore[arg-type]
        assert str(refused.value) == message
    for optional in ("tp", "sharing_ratio", "output_tokens", "capacity_blocks", "max_num_seqs", "metrics_interval"):
        assert getattr(SimSpec(**{optional: None}), optional) is None  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="^unknown model 'gpt-9'; valid models: codellama-13b, "):
        SimSpec(model="gpt-9")
    with pytest.raises(ConfigurationError, match="^unknown GPU 'tpu'; valid GPUs: a100-40gb, "):
        SimSpec(gpu="tpu")
    with pytest.raises(ConfigurationError, match=r"^no profile for codellama-13b on a100-40gb with tp=3; valid tp"):
        SimSpec(tp=3)


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("rate", "--rate"),
        ("speedup", "--speedup"),
        ("duration", "--duration"),
        ("metrics_interval", "--metrics-interval"),
        ("think_time", "--think-time"),
        ("gpu_hour_usd", "--gpu-hour-usd"),
        ("sharing_ratio", "--sharing-ratio"),
        ("gpu_memory_utilization", "gpu_memory_utilization"),
    ],
)
def test_an_int_too_large_for_a_float_is_not_finite(field: str, flag: str) -> None:
    # math.isfinite(10**400) raises OverflowError: the check must say which option instead.
    extra = {"users": None, "requests": 5} if field == "rate" else {"requests": None} if field == "duration" else {}
    for huge in (10**400, -(10**400), 10**5000):  # 10**5000: past the int-to-str limit, so its repr would fail too
        with pytest.raises(ConfigurationError, match=f"^{flag} ") as caught:
            SimSpec(**{field: huge, **extra})  # type: ignore[arg-type]
        assert "an int of" in str(caught.value) and len(str(caught.value)) < 200


def test_open_loop_and_metrics_interval_refuse_huge_ints() -> None:
    from prefixroute.router import Router
    from prefixroute.sim.backend import BackendConfig
    from prefixroute.sim.baselines import DynamoKvRouter
    from prefixroute.sim.engine import OpenLoop, Simulation
    from prefixroute.sim.workloads import make_workload

    from .conftest import LinearCost

    common = {"router": Router(), "workload": make_workload("seed"), "cost": LinearCost()}
    common |= {"config": BackendConfig(capacity_blocks=10), "max_requests": 1}
    with pytest.raises(ConfigurationError, match="rate must be a finite number > 0"):  # when the arrivals are made
        Simulation(arrivals=OpenLoop(rate=10**400), **common)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="metrics_interval must be a finite number"):
        Simulation(arrivals=OpenLoop(rate=1.0), metrics_interval=10**400, **common)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="temperature must be a finite number"):
        DynamoKvRouter(temperature=10**400)


def test_numpy_integers_are_taken_where_the_simulator_takes_an_int() -> None:
    """numpy's ints (a sweep over np.arange, say) were refused everywhere but in token ids; bools still are."""
    import numpy as np

    from prefixroute.router import Router
    from prefixroute.sim.backend import BackendConfig
    from prefixroute.sim.baselines import SGLangCacheAware
    from prefixroute.sim.engine import ClosedLoop, Simulation
    from prefixroute.sim.kvcache import BlockCache
    from prefixroute.sim.profiles import load_profile
    from prefixroute.sim.workloads import make_workload

    from .conftest import LinearCost

    npa: Any = np  # numpy's ints typed loosely: stubs differ on whether they are ints
    spec = SimSpec(requests=npa.int64(20), users=npa.int32(4), backends=npa.int64(2), seed=npa.int64(3))
    assert all(type(v) is int for v in (spec.requests, spec.users, spec.backends, spec.seed))
    assert run_policy(spec, "round-robin").to_json() == run_policy(spec.with_(seed=3), "round-robin").to_json()
    config = BackendConfig(capacity_blocks=npa.int64(50), max_num_seqs=npa.int16(4))
    assert type(config.capacity_blocks) is int and type(config.max_num_seqs) is int
    assert type(BlockCache(npa.uint32(8))._capacity) is int
    assert load_profile("codellama-13b", "a100-40gb", tp=npa.int64(1)).tp == 1
    assert type(ClosedLoop(npa.int64(2)).users) is int
    workload = make_workload("seed", seed=npa.int64(1))
    assert isinstance(SGLangCacheAware(seed=npa.int64(1)), LoadPolicy)
    simulation = Simulation(
        router=Router(), workload=workload, arrivals=ClosedLoop(2), cost=LinearCost(), config=config,
        backends=npa.int64(2), max_requests=npa.int64(5), seed=npa.int64(1), gpus_per_backend=npa.int8(1),
    )  # fmt: skip
    assert simulation.names == ["gpu0", "gpu1"] and len(simulation.run().records) == 5
    bads: list[Any] = [True, npa.bool_(True), 20.0]
    for bad in bads:
        with pytest.raises(ConfigurationError, match="--requests"):
            SimSpec(requests=bad)
        with pytest.raises(ConfigurationError, match="capacity_blocks"):
            BlockCache(bad)


def test_vllm_defaults_follow_gpu_memory_and_keep_a100s_on_the_small_budget() -> None:
    # vLLM's EngineArgs.get_batch_defaults: >= 70 GiB and not an A100 (PR #17885: a large budget slows A100s).
    assert vllm_defaults(40 * 2**30) == (256, 2048)
    assert vllm_defaults(80 * 2**30) == (1024, 8192)
    assert vllm_defaults(70 * 2**30) == (1024, 8192) and vllm_defaults(70 * 2**30 - 1) == (256, 2048)
    assert vllm_defaults(80 * 2**30, gpu="h100-80gb") == (1024, 8192)
    assert vllm_defaults(80 * 2**30, gpu="a100-80gb") == (256, 2048)
    assert vllm_defaults(80 * 2**30, gpu="NVIDIA A100-SXM4-80GB") == (256, 2048)
    with pytest.raises(InvalidTypeError, match="^gpu must be a GPU's name, a str, not int"):
        vllm_defaults(80 * 2**30, gpu=5)  # type: ignore[arg-type]


USER_POLICIES = '''
import random

from prefixroute.policies import LoadPolicy


class RngPolicy(LoadPolicy):
    """Uniformly random; unseeded unless the simulator passes rng."""

    def __init__(self, *, rng=None):
        self.rng = rng if rng is not None else random.Random()

    def choose(self, candidates):
        return candidates[self.rng.randrange(len(candidates))]


class SeedPolicy(LoadPolicy):
    """Uniformly random; unseeded unless the simulator passes seed."""

    def __init__(self, seed=None):
        self.rng = random.Random(seed)

    def choose(self, candidates):
        return candidates[self.rng.randrange(len(candidates))]
'''


@pytest.mark.parametrize("policy", ["RngPolicy", "SeedPolicy"])
def test_user_policies_taking_rng_or_seed_are_seeded(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_seeded_policies.py").write_text(USER_POLICIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"my_seeded_policies:{policy}"
    spec = SimSpec(requests=60, users=6)
    first, second = run_policy(spec, name), run_policy(spec, name)
    assert first.to_json() == second.to_json()  # same seed, same result
    assert run_policy(spec.with_(seed=1), name).to_json() != first.to_json()  # the seed reaches the policy
    assert isinstance(build_policy(name, seed=3), LoadPolicy)


def test_a_spec_copy_names_a_field_it_does_not_have_and_checks_the_values_it_does() -> None:
    # Was: SimSpec.with_(nope=1) raised dataclasses' TypeError ("unexpected keyword argument").
    spec = SimSpec(scenario="rag")
    with pytest.raises(ConfigurationError, match="SimSpec has no field 'nope': its fields are scenario, "):
        spec.with_(nope=1)
    with pytest.raises(ConfigurationError, match="backends"):
        spec.with_(backends=0)
    assert spec.with_(backends=3).backends == 3 and spec.backends != 3


class _Watcher(RoundRobin):
    """Round-robin that keeps every set of candidates it was offered: what a policy sees from the simulation."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[Sequence[Candidate]] = []

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        self.offered.append(candidates)
        return super().choose(candidates)


def test_a_policy_sees_the_capacity_speed_and_engine_load_a_fleet_would_give_it() -> None:
    spec = SimSpec(requests=40, users=4, backends=2, capacity_blocks=5000)
    watcher = _Watcher()
    run_policy(spec, lambda: watcher)
    last = watcher.offered[-1]
    assert [c.capacity_blocks for c in last] == [5000, 5000]  # the index is capped at the engines' KV capacity
    # First tokens teach the router each engine's prefill speed, timed on the simulated clock: a real clock would
    # make it millions of tokens/s, a clock that stands still would teach nothing.
    solo = 2048 / load_profile(spec.model, spec.gpu).prefill_seconds(2048, 0)
    assert all(c.prefill_tokens_per_s is not None and 0 < c.prefill_tokens_per_s < 10 * solo for c in last)
    assert all(c.queue_len is None and c.kv_usage is None for c in last)  # no engine metrics unless polled

    watcher = _Watcher()
    run_policy(spec.with_(first_token=False, metrics_interval=0.5), lambda: watcher)
    last = watcher.offered[-1]
    assert all(c.prefill_tokens_per_s is None for c in last)  # a gateway that reports no first token
    assert all(c.queue_len is not None and c.kv_usage is not None and 0 < c.kv_usage <= 1 for c in last)


def _tiny_trace(folder: Path) -> str:
    """Six requests a second apart, each 1,024 tokens (two of Mooncake's 512-token blocks) and 8 out."""
    lines = [
        json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 8, "hash_ids": [0, 100 + i]})
        for i in range(6)
    ]
    path = folder / "tiny.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return f"mooncake:{path}"


def test_a_trace_is_replayed_at_its_timestamps_or_by_closed_loop_users(tmp_path: Path) -> None:
    spec = SimSpec(trace=_tiny_trace(tmp_path), users=None, requests=None)
    replay = run_policy(spec, "round-robin")
    assert replay.requests == 6 and 5.0 <= replay.duration_s < 6.0  # the last request arrives at 5 s
    faster = run_policy(spec.with_(speedup=2.0), "round-robin")
    assert faster.requests == 6 and 2.5 <= faster.duration_s < 3.5
    assert run_policy(spec.with_(requests=4), "round-robin").requests == 4  # the first four
    longer = run_policy(spec.with_(output_tokens=100), "round-robin")
    assert longer.e2e_ms["p50"] > replay.e2e_ms["p50"]  # every request now decodes 100 tokens, not the trace's 8
    one_user = run_policy(spec.with_(users=1), "round-robin")  # back to back, not at the trace's times
    assert one_user.requests == 6 and one_user.duration_s < replay.duration_s
    thinking = run_policy(spec.with_(users=1, think_time=2.0), "round-robin")
    assert thinking.duration_s > one_user.duration_s + 2.0
    three = run_policy(spec, "round-robin", workload=lambda: load_trace(spec.trace or "", limit=3))
    assert three.requests == 3  # a trace already read replaces the spec's, which still gives the arrivals


def test_the_polling_limit_counts_the_span_each_kind_of_arrivals_takes() -> None:
    # Open loop: --requests ÷ --rate seconds; closed loop: --requests × --think-time ÷ --users. 10^8 polls at most.
    for over in (
        {"users": None, "rate": 0.01, "requests": 2000},
        {"users": 10, "think_time": 2000.0, "requests": 1000},
    ):
        with pytest.raises(ConfigurationError, match="over 100,000,000 polls"):
            SimSpec(metrics_interval=0.001, **over)
    for under in (
        {"users": None, "rate": 100.0, "requests": 2000},  # 20 s
        {"users": 100, "think_time": 10.0, "requests": 1000},  # 100 s
        {"users": 100, "requests": 1000},  # no think time: the run alone tells how long
    ):
        assert SimSpec(metrics_interval=0.001, **under).metrics_interval == 0.001
    # A trace replayed by closed-loop users until it ends: its length is known only when it is read.
    assert SimSpec(trace="mooncake:t.jsonl", users=5, think_time=1.0, requests=None, metrics_interval=0.001)


def test_messages_name_a_flag_only_for_options_the_command_has() -> None:
    with pytest.raises(ConfigurationError, match=r"^--backends must be an int"):
        SimSpec(backends=0)
    for field in ("capacity_blocks", "max_num_seqs", "max_num_batched_tokens", "output_tokens"):  # API only
        with pytest.raises(ConfigurationError, match=f"^{field} must be an int"):
            SimSpec(**{field: 0})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="^SimSpec has no field 'nada', 'nope': its fields are scenario, "):
        SimSpec().with_(nope=1, nada=2)


def test_run_options_reach_the_run_and_the_summary() -> None:
    spec = SimSpec(requests=40, users=4)
    progress: list[tuple[int, int]] = []
    result = run_policy(spec, "round-robin", label="rr", on_progress=lambda *done: progress.append(done))
    assert result.policy == "rr" and result.requests == 40
    assert progress == [(done, 40) for done in range(1, 41)]
    assert result.recompute_usd_per_month > 0  # round-robin recomputes prefixes: the figure --gpu-hour-usd prices
    dearer = run_policy(spec.with_(gpu_hour_usd=4.0), "round-robin")
    assert dearer.recompute_usd_per_month == pytest.approx(2 * result.recompute_usd_per_month)
    timed = run_policy(SimSpec(users=4, requests=None, duration=3.0), "round-robin")
    assert 0 < timed.requests < 40  # arrivals stop at --duration


def test_the_seed_draws_the_arrivals_too() -> None:
    prompts = lambda: make_workload("seed", seed=0)  # noqa: E731  # the same prompts whatever the spec's seed
    spec = SimSpec(users=None, rate=5.0, requests=30)
    first = run_policy(spec, "round-robin", workload=prompts).to_json()
    assert run_policy(spec, "round-robin", workload=prompts).to_json() == first
    assert run_policy(spec.with_(seed=1), "round-robin", workload=prompts).to_json() != first


def test_the_scenario_is_drawn_with_the_spec_s_seed_sharing_ratio_and_think_time() -> None:
    spec = SimSpec(requests=60, users=6)
    shared = run_policy(spec, "prefix-affinity")
    assert shared.hit_rate > 0.5
    assert run_policy(spec.with_(sharing_ratio=0.0), "prefix-affinity").hit_rate == 0.0  # every prompt its own
    other = run_policy(spec.with_(seed=1), "prefix-affinity")  # another seed, other prompts
    assert {tag: prompt for tag, (_, prompt) in other.tag_tokens.items()} != {
        tag: prompt for tag, (_, prompt) in shared.tag_tokens.items()
    }
    chat = SimSpec(scenario="multi-turn", users=2, requests=20)  # its users think 2 s between turns
    durations = [run_policy(chat.with_(think_time=t), "round-robin").duration_s for t in (0.0, None, 10.0)]
    assert durations == sorted(durations) and durations[0] + 20 < durations[2]


def test_backend_config_sizes_the_engines_as_vllm_would_unless_told() -> None:
    config, profile = backend_config(SimSpec())
    assert profile == load_profile("codellama-13b", "a100-40gb")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (256, 2048, 16)
    assert config.capacity_blocks == profile.kv_capacity_blocks(16, max_num_batched_tokens=2048, max_num_seqs=256)
    config, profile = backend_config(SimSpec(gpu="h100-80gb", tp=2, gpu_memory_utilization=0.5))
    assert profile.tp == 2 and (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 8192)
    assert config.capacity_blocks == profile.kv_capacity_blocks(
        16, gpu_memory_utilization=0.5, max_num_batched_tokens=8192, max_num_seqs=1024
    )
    assert backend_config(SimSpec(gpu="a100-80gb"))[0].max_num_batched_tokens == 2048  # as vLLM runs an A100
    given = SimSpec(gpu="h100-80gb", max_num_seqs=8, max_num_batched_tokens=512)
    config, profile = backend_config(given)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (8, 512)
    assert config.capacity_blocks == profile.kv_capacity_blocks(16, max_num_batched_tokens=512, max_num_seqs=8)
    assert backend_config(given.with_(capacity_blocks=100))[0].capacity_blocks == 100


class _OwnError(PrefixRouteError):
    """A user's error class in the library's tree, with a constructor of its own."""

    def __init__(self, code: int) -> None:
        super().__init__(f"code {code}")
        self.code = code


class _Refuses(RoundRobin):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        raise self.error


def test_a_run_is_named_by_label_registry_name_or_the_policy_s_repr_and_so_are_its_errors() -> None:
    spec = SimSpec(requests=4, users=2, backends=2)
    assert run_policy(spec, BoundedLoad).policy == repr(BoundedLoad())  # a factory: the policy it built
    assert run_policy(spec, "bounded-load").policy == "bounded-load"
    refusal = NoBackendError("none of these will do")
    with pytest.raises(NoBackendError, match=r"^mine: none of these will do$") as named:
        run_policy(spec, lambda: _Refuses(refusal), label="mine")
    assert named.value.__cause__ is refusal  # the traceback still leads to the policy's own raise
    own = _OwnError(7)
    with pytest.raises(_OwnError) as passed:  # not rebuilt: its constructor takes other arguments
        run_policy(spec, lambda: _Refuses(own), label="mine")
    assert passed.value is own and str(own) == "code 7"
    with pytest.raises(InvalidTypeError, match="^spec must be a SimSpec, not dict$"):
        run_policy({"requests": 4}, "round-robin")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="^policy must be a name or a callable returning a LoadPolicy, not int$"):
        run_policy(spec, 5)  # type: ignore[arg-type]
    for option in ("workload", "on_progress"):
        with pytest.raises(InvalidTypeError, match=f"^{option} must be a callable or None, not int$"):
            run_policy(spec, "round-robin", **{option: 5})  # type: ignore[arg-type]


def test_a_run_charges_recomputation_on_every_gpu_of_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation is told how many GPUs each engine spans (the profile's tensor parallelism, or ``--tp``)."""
    from prefixroute.sim.engine import Simulation

    built: list[int] = []

    def spy(*args: Any, **kwargs: Any) -> Simulation:
        built.append(kwargs["gpus_per_backend"])
        return Simulation(*args, **kwargs)

    monkeypatch.setattr("prefixroute.sim.runner.Simulation", spy)
    run_policy(SimSpec(requests=4, users=2, model="llama-2-70b", gpu="a100-80gb"), "round-robin")
    run_policy(SimSpec(requests=4, users=2, model="codellama-13b", gpu="a100-40gb", tp=4), "round-robin")
    assert built == [load_profile("llama-2-70b", "a100-80gb").tp, 4] and built[0] > 1


@pytest.mark.parametrize("made", [None, "round-robin", RoundRobin])
def test_a_policy_factory_must_return_a_policy(made: object) -> None:
    """A factory returning None ran Router()'s default policy under the factory's label, as if it were the policy."""
    with pytest.raises(InvalidTypeError, match="policy\\(\\) must return a LoadPolicy instance, not"):
        factory: Any = lambda: made  # noqa: E731 - typed as what a caller without a type checker passes
        run_policy(SimSpec(requests=5, backends=2), factory)
