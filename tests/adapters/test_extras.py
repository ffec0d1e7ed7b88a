"""Each gateway adapter imports only what its own extra installs: ``prefixroute[litellm]`` and ``prefixroute[ray]``
do not bring the proxy's aiohttp and pyzmq or the sidecar's uvicorn, so importing either adapter must not import
those packages' modules (it did, through ``prefixroute.adapters.proxy``'s and ``serve``'s ``__init__``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Modules of other extras than the adapter's own (litellm and ray themselves import aiohttp, prometheus_client or
# uvicorn, so those are not listed).
OTHER_EXTRAS = ("prefixroute.adapters.proxy.app", "prefixroute.adapters.serve.app", "zmq")


@pytest.mark.parametrize("adapter", ["prefixroute.adapters.litellm", "prefixroute.adapters.ray"])
def test_an_adapter_imports_nothing_of_the_other_extras(adapter: str) -> None:
    code = f"import sys, {adapter}; print(sorted(set({OTHER_EXTRAS!r}) & set(sys.modules)))"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_the_lazy_package_names_still_import() -> None:
    from prefixroute.adapters import proxy
    from prefixroute.adapters.proxy import ByteEncoder, Proxy
    from prefixroute.adapters.serve import BadRequest, Sidecar

    assert Proxy.__module__.endswith("proxy.app") and Sidecar.__module__.endswith("serve.app")
    assert ByteEncoder.__module__.endswith("prompts") and BadRequest.__module__.endswith("contract")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        getattr(proxy, "Nope")  # noqa: B009
