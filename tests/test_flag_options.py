"""Every flag option of the public API takes True or False and refuses anything else, whatever its type, with a
ConfigurationError naming the option, as every option given a value it cannot use does (errors.py,
docs/index.md): a truthy value such as "no" or 1 never switches a flag on."""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from prefixroute import ConfigurationError, PredictedTTFT, Router
from prefixroute._numbers import shown
from prefixroute.adapters.serve.text import PromptEncoder
from prefixroute.adapters.tokenize import PromptTokenizer
from prefixroute.sim import BackendConfig, ClosedLoop, SimSpec, Simulation, make_workload, run_policy
from prefixroute.testing import FakeBlockCache, FakeVLLM

from .sim.conftest import LinearCost
from .test_public_api import _public_callables


def _simulation(**flag: Any) -> Simulation:
    return Simulation(
        router=Router(), workload=make_workload("seed"), arrivals=ClosedLoop(2), cost=LinearCost(),
        config=BackendConfig(capacity_blocks=100), backends=2, max_requests=2, **flag,
    )  # fmt: skip


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _from_file(add_special_tokens: Any) -> PromptTokenizer:
    path = Path("tokenizer.json")  # in the test's own tmp_path
    _tokenizer().save(str(path))
    return PromptTokenizer.from_file(path, add_special_tokens=add_special_tokens)


def _encoded_chat(flag: str, value: Any) -> list[int]:
    _tokenizer().save("tokenizer.json")  # in the test's own tmp_path
    options = {"add_generation_prompt": False, flag: value}  # both true is refused for itself
    return PromptEncoder("tokenizer.json").encode_chat([{"role": "user", "content": "a"}], **options)


def _encoded_text(add_special_tokens: Any) -> list[int]:
    _tokenizer().save("tokenizer.json")  # in the test's own tmp_path
    return PromptEncoder("tokenizer.json").encode("a", add_special_tokens=add_special_tokens)


def _cache() -> FakeBlockCache:
    return FakeBlockCache(block_size=4, num_blocks=16, rng=random.Random(0))


def _fake_vllm(flag: str, value: Any) -> FakeVLLM:
    return FakeVLLM(**{flag: value})  # built, never started


def _backend_config(flag: str, value: Any) -> BackendConfig:
    return BackendConfig(capacity_blocks=4, **{flag: value})


def _completed(flag: str, value: Any) -> object:
    return FakeVLLM().complete(list(range(32)), **{flag: value})  # not started: complete() works on the cache alone


# ``Name(option=)``: a call that gives the flag ``value`` (the name as the message names the option).
FLAGS: dict[str, tuple[str, Callable[[Any], object]]] = {
    "PredictedTTFT(use_speed=)": ("PredictedTTFT use_speed", lambda v: PredictedTTFT(use_speed=v)),
    "SimSpec(first_token=)": ("first_token", lambda v: SimSpec(requests=2, first_token=v)),
    "Simulation(check=)": ("check", lambda v: _simulation(check=v)),
    "Simulation(kv_events=)": ("kv_events", lambda v: _simulation(kv_events=v)),
    "Simulation(first_token=)": ("first_token", lambda v: _simulation(first_token=v)),
    "run_policy(check=)": ("check", lambda v: run_policy(SimSpec(requests=2, backends=2), "round-robin", check=v)),
    "PromptTokenizer(add_special_tokens=)": (
        "add_special_tokens", lambda v: PromptTokenizer(_tokenizer(), add_special_tokens=v)),
    "PromptTokenizer.from_file(add_special_tokens=)": ("add_special_tokens", _from_file),
    "FakeBlockCache(extra_group=)": (
        "extra_group", lambda v: FakeBlockCache(rng=random.Random(0), extra_group=v)),
    "FakeBlockCache.allocate(share=)": ("share", lambda v: _cache().allocate(list(range(8)), share=v)),
    **{f"FakeVLLM({flag}=)": (flag, functools.partial(_fake_vllm, flag))
       for flag in ("extra_group", "replay", "replay_topic", "legacy_metric_names")},
    **{f"FakeVLLM.complete({flag}=)": (flag, functools.partial(_completed, flag)) for flag in ("share", "hold")},
    **{f"PromptEncoder.encode_chat({flag}=)": (flag, functools.partial(_encoded_chat, flag))
       for flag in ("add_generation_prompt", "continue_final_message", "add_special_tokens")},
    "PromptEncoder.encode(add_special_tokens=)": ("add_special_tokens", _encoded_text),
    **{f"BackendConfig({flag}=)": (flag, functools.partial(_backend_config, flag))
       for flag in ("reserve_full_isl", "async_scheduling")},
}  # fmt: skip

# Flags that are no option: what happened to one request, reported to finish() (an argument, as the decision is),
# whose wrong type is the InvalidTypeError (a TypeError) that Router.finish documents as the only error it raises.
REPORTS = {"Router.finish(refused=)", "Sidecar.finish(refused=)"}


def test_every_flag_option_of_the_public_api_is_listed_here() -> None:
    flags = {
        f"{name}({parameter.name}=)"
        for name, function in _public_callables()
        for parameter in inspect.signature(function).parameters.values()
        if isinstance(parameter.default, bool)
    }
    assert flags == set(FLAGS) | REPORTS


@pytest.mark.parametrize("flag", FLAGS)
def test_a_flag_takes_a_bool_and_refuses_anything_else_with_a_configuration_error(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    option, give = FLAGS[flag]
    for bad in ("no", "", 1, 0, 1.0, None, [True]):
        with pytest.raises(ConfigurationError) as refused:
            give(bad)
        assert str(refused.value) == f"{option} must be True or False, not {shown(bad)}"
    give(True)
    give(False)
