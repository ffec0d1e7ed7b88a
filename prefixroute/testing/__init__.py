"""Test doubles that speak vLLM's real protocols on loopback (needs the ``prefixroute[vllm]`` extra)."""

from __future__ import annotations

from prefixroute.testing.fake_cache import CachedChain, FakeBlockCache, FakeRequest
from prefixroute.testing.fake_vllm import Completion, FakeVLLM

__all__ = ["CachedChain", "Completion", "FakeBlockCache", "FakeRequest", "FakeVLLM"]
