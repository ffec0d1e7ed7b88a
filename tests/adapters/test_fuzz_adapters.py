"""Hostile values at the adapters' public constructors and functions: a call either works or raises an error of the
library's tree (a wrong type is its :class:`InvalidTypeError`), never a raw error from deep inside.

Bounded (a few hundred examples per test, no server started) so the file runs in seconds; the defects it found are
pinned one by one in test_fuzz_adapters_findings.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixroute import Router
from prefixroute.adapters.proxy import ByteEncoder, Proxy, TokenizerEncoder
from prefixroute.adapters.serve import PromptEncoder, Sidecar, release_ids, upstream_of
from prefixroute.adapters.tokenize import PromptTokenizer, TextRouter, serialise_chat
from prefixroute.adapters.urls import check_backend_url

from ..conftest import StrSubclass, call_or_refuse, hostile_values

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported: no network
from prefixroute.adapters.litellm import PrefixRouteHook  # noqa: E402

_ATOMS: list[object] = [
    None, True, False, 0, -1, 1, 3, 2**64, 10**400, 0.0, 1.5, math.nan, math.inf, -math.inf, "", "x", "\ud800",
    "a\x00b", "x" * 5000, StrSubclass("x"), b"", b"ab", bytearray(b"ab"), [], (), {}, [None], ["m", "m"], ["m"],
    object(), np.int64(3), np.float64(2.0), np.array([1, 2]), "http://127.0.0.1:1", ["http://127.0.0.1:1"],
    ["http://127.0.0.1:1", "http://127.0.0.1:1"], [{"role": "user", "content": "hi"}], [{"role": None}],
    [{"role": "user", "content": [1, {"text": 5}, {"text": "\ud800"}]}], [{"role": "u", "content": {"a": 1}}],
    [[{"role": "user"}]], ["x"], [b"x"], print,
]  # fmt: skip

hostile = hostile_values(_ATOMS)


_FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _router() -> Router:
    return Router(block_size=4)


def _option(build: Callable[..., object], option: str) -> Callable[[Any], object]:
    return lambda value: build(**{option: value})


_CONSTRUCTORS: dict[str, Callable[[Any], object]] = {
    "Proxy router": lambda v: Proxy(v, ["http://127.0.0.1:1"]),
    "Proxy backends": lambda v: Proxy(_router(), v),
    **{f"Proxy {o}": _option(lambda **kw: Proxy(_router(), ["http://127.0.0.1:1"], **kw), o)
       for o in ("encoder", "fleet", "retries", "max_failures", "cooldown", "connect_timeout", "base_models",
                 "clock")},
    "Sidecar router": lambda v: Sidecar(v),
    **{f"Sidecar {o}": _option(lambda **kw: Sidecar(_router(), **kw), o)
       for o in ("backends", "encoder", "models", "base_models", "lease", "healthy", "accel_redirect",
                 "max_body_bytes", "clock")},
    "PrefixRouteHook router": lambda v: PrefixRouteHook(v),
    **{f"PrefixRouteHook {o}": _option(lambda **kw: PrefixRouteHook(_router(), **kw), o)
       for o in ("encoder", "model_groups", "base_groups", "lease")},
    "TokenizerEncoder": lambda v: TokenizerEncoder(v),
    "PromptTokenizer": lambda v: PromptTokenizer(v),
    "PromptTokenizer.from_file": lambda v: PromptTokenizer.from_file(v),
    "PromptEncoder": lambda v: PromptEncoder(v),
    "ByteEncoder.encode": lambda v: ByteEncoder().encode(v),
    "ByteEncoder.encode_chat": lambda v: ByteEncoder().encode_chat(v),
    "serialise_chat": lambda v: serialise_chat(v),
    "check_backend_url": lambda v: check_backend_url(v),
    "upstream_of": lambda v: upstream_of(v),
    "release_ids": lambda v: release_ids(v),
}  # fmt: skip


@_FAST
@given(name=st.sampled_from(sorted(_CONSTRUCTORS)), value=hostile)
def test_adapter_constructors_and_functions_refuse_hostile_values_with_the_library_s_errors(
    name: str, value: object
) -> None:
    call_or_refuse(_CONSTRUCTORS[name], value)


@pytest.fixture(scope="module")
def encoders(model_dir: Path) -> dict[str, Any]:
    tokenizer = PromptTokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    return {"tokenizer": tokenizer, "encoder": TokenizerEncoder(tokenizer), "prompt": PromptEncoder(model_dir)}


_TEXTS = st.one_of(hostile, st.text(max_size=40), st.builds(lambda s: s * 300, st.text(min_size=1, max_size=8)))
_MESSAGES = st.lists(
    st.one_of(st.sampled_from(_ATOMS), st.dictionaries(st.sampled_from(["role", "content", "x"]), _TEXTS, max_size=3)),
    max_size=3,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_TEXTS, messages=st.one_of(_MESSAGES, hostile))
def test_encoders_refuse_hostile_texts_and_messages_with_the_library_s_errors(
    encoders: dict[str, Any], text: object, messages: object
) -> None:
    tokenizer, encoder, prompt = encoders["tokenizer"], encoders["encoder"], encoders["prompt"]
    call_or_refuse(tokenizer.encode, text)
    call_or_refuse(tokenizer.encode_batch, text)
    call_or_refuse(tokenizer.encode_batch, [text])
    call_or_refuse(TextRouter(_router(), tokenizer).route, text, ["gpu0"])
    for each in (encoder, prompt, ByteEncoder()):
        call_or_refuse(each.encode, text)
        call_or_refuse(each.encode_chat, messages)


_CALLS = st.lists(
    st.one_of(
        hostile,
        st.fixed_dictionaries(
            {"function": st.one_of(hostile, st.fixed_dictionaries({"name": _TEXTS, "arguments": _TEXTS}))}
        ),
    ),
    max_size=2,
)
_CHAT_BODIES = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.one_of(
            _MESSAGES,
            st.lists(st.fixed_dictionaries({"role": st.just("assistant"), "content": _TEXTS, "tool_calls": _CALLS})),
            hostile,
        ),
        "tools": st.one_of(hostile, st.lists(st.one_of(hostile, st.fixed_dictionaries({"function": hostile})))),
        "documents": st.one_of(hostile, st.lists(hostile, max_size=2)),
        "add_generation_prompt": hostile,
        "continue_final_message": hostile,
        "chat_template_kwargs": st.one_of(
            hostile, st.dictionaries(_TEXTS.filter(lambda t: isinstance(t, str)), hostile)
        ),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(_CHAT_BODIES, hostile))
def test_a_hostile_chat_request_is_rendered_or_refused_with_the_library_s_errors(
    encoders: dict[str, Any], body: object
) -> None:
    call_or_refuse(encoders["prompt"].encode_chat_request, body)
