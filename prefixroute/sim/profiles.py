"""Catalogue of model and GPU specs and the calibrated model x GPU profiles shipped as package data.

>>> from prefixroute.sim import load_profile
>>> profile = load_profile("codellama-13b", "a100-40gb")
>>> profile.tp, profile.kv_capacity_blocks() > 0
(1, True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any

from prefixroute._numbers import as_int, shown
from prefixroute.errors import ConfigurationError, InvalidTypeError
from prefixroute.sim.costmodel import CostCoefficients, GpuSpec, ModelSpec, Profile

__all__ = [
    "GPUS",
    "MIN_KV_TOKENS",
    "MODELS",
    "TP_DEGREES",
    "available_profiles",
    "load_profile",
]

_GIB = 1024**3

#: Datasheet figures (SXM parts, dense BF16). Memory in GiB as nvidia-smi reports it.
GPUS: Mapping[str, GpuSpec] = MappingProxyType(
    {
        "a100-40gb": GpuSpec("a100-40gb", 40 * _GIB, 1.555e12, 312e12),
        "a100-80gb": GpuSpec("a100-80gb", 80 * _GIB, 2.039e12, 312e12),
        "h100-80gb": GpuSpec("h100-80gb", 80 * _GIB, 3.35e12, 989e12),
    }
)

#: Shapes from each model's Hugging Face ``config.json``; params are the exact parameter counts.
MODELS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        "llama-2-7b": ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 6_738_415_616, 4096),
        "llama-3-8b": ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8_030_261_248, 8192),
        "codellama-13b": ModelSpec("codellama-13b", 40, 5120, 40, 40, 128, 13824, 32016, 13_016_028_160, 16384),
        "codellama-34b": ModelSpec("codellama-34b", 48, 8192, 64, 8, 128, 22016, 32000, 33_743_970_304, 16384),
        "llama-2-70b": ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 68_976_648_192, 4096),
    }
)

#: Tensor-parallel degrees a profile exists for.
TP_DEGREES = (1, 2, 4, 8)

#: Automatic tp needs room for at least this many KV tokens per engine (one full Llama-2 context):
#: below it vLLM cannot hold one long request and the deployment is not a sensible one.
MIN_KV_TOKENS = 4096

_DATA_FILE = "profiles.json"


@lru_cache(maxsize=1)
def _coefficients() -> Mapping[tuple[str, str, int], CostCoefficients]:
    """Read the packaged profile table once (an immutable mapping, cached)."""
    text = resources.files("prefixroute.sim.data").joinpath(_DATA_FILE).read_text(encoding="utf-8")
    document: dict[str, Any] = json.loads(text)
    table: dict[tuple[str, str, int], CostCoefficients] = {}
    for entry in document["profiles"]:
        key = (str(entry["model"]), str(entry["gpu"]), int(entry["tp"]))
        table[key] = CostCoefficients(**entry["coefficients"])
    return MappingProxyType(table)


def available_profiles() -> list[tuple[str, str]]:
    """Every ``(model, gpu)`` pair with a calibrated profile, sorted."""
    return sorted({(model, gpu) for model, gpu, _ in _coefficients()})


def _check_names(model: str, gpu: str) -> None:
    for what, name in (("model", model), ("GPU", gpu)):
        if not isinstance(name, str):
            raise InvalidTypeError(f"a {what} name is a str, not {type(name).__name__}")
    if model not in MODELS:
        raise ConfigurationError(f"unknown model {model!r}; valid models: {', '.join(sorted(MODELS))}")
    if gpu not in GPUS:
        raise ConfigurationError(f"unknown GPU {gpu!r}; valid GPUs: {', '.join(sorted(GPUS))}")


def load_profile(model: str, gpu: str, *, tp: int | None = None) -> Profile:
    """Return the calibrated profile of ``model`` on ``gpu`` with tensor-parallel degree ``tp``.

    With ``tp=None`` the smallest degree in :data:`TP_DEGREES` whose weights fit with room for
    :data:`MIN_KV_TOKENS` tokens of KV cache (at vLLM's default 0.9 memory utilization) is chosen.
    Raises :class:`~prefixroute.errors.ConfigurationError` for an unknown model, GPU or tp, listing
    the valid ones, or when the model does not fit even at the largest degree;
    :class:`~prefixroute.errors.InvalidTypeError` for a model or GPU name that is not a str.
    """
    _check_names(model, gpu)
    table = _coefficients()
    if tp is None:
        for degree in TP_DEGREES:
            candidate = Profile(MODELS[model], GPUS[gpu], degree, table[(model, gpu, degree)])
            if candidate.kv_capacity_blocks(1) >= MIN_KV_TOKENS:
                return candidate
        raise ConfigurationError(f"{model} does not fit on {max(TP_DEGREES)} x {gpu}; choose a larger GPU")
    given = as_int(tp)
    if given is None or (model, gpu, given) not in table:
        valid = sorted(degree for m, g, degree in table if (m, g) == (model, gpu))
        raise ConfigurationError(f"no profile for {model} on {gpu} with tp={shown(tp)}; valid tp: {valid}")
    return Profile(MODELS[model], GPUS[gpu], given, table[(model, gpu, given)])
