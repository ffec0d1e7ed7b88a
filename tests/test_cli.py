from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from types import ModuleType
from typing import Any

import pytest

from prefixroute import cli


def test_no_command_lists_every_subcommand_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    listed = capsys.readouterr().err
    assert listed.count("\n") == 1 and "--help" in listed, listed
    for _extra, commands in cli.COMMAND_MODULES.values():
        for command in commands:
            assert command in listed


def test_a_command_whose_extra_is_missing_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = importlib.import_module

    def without_vllm(name: str, package: str | None = None) -> ModuleType:
        if name.startswith("prefixroute.vllm"):
            raise ImportError("No module named 'httpx'")
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", without_vllm)
    assert cli.main(["doctor", "http://gpu0:8000"]) == 2
    assert "pip install 'prefixroute[vllm]'" in capsys.readouterr().err
    assert "prefixroute.sim.cli" in sys.modules  # the other commands still load
    # Its own --help says so too (was: a usage line with no option and no word of the extra).
    with pytest.raises(SystemExit) as exited:
        cli.main(["doctor", "--help"])
    assert exited.value.code == 0 and "needs: pip install 'prefixroute[vllm]'" in capsys.readouterr().out


def test_a_command_whose_extra_is_partly_missing_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The command modules import some of their extra's packages only when they run (`simulate` imports rich for its
    # table): the CLI looks them up first, so a core-only install says what to install instead of a traceback.
    real_find_spec = importlib.util.find_spec

    def without_rich(name: str, package: str | None = None) -> Any:
        return None if name == "rich" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_rich)
    assert cli.main(["simulate", "--requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'prefixroute[sim]'" in err and "'rich'" in err and err.count("\n") == 1, err


# Distributions whose import name is not their name (uvloop is platform-conditional, so the CLI does not require it).
_IMPORT_NAMES = {"pyzmq": "zmq", "prometheus-client": "prometheus_client", "grpcio": "grpc", "xds-protos": "envoy"}


@pytest.mark.parametrize("extra", sorted(cli.EXTRA_MODULES))
def test_each_extra_s_modules_are_those_pyproject_lists(extra: str) -> None:
    requirements = importlib.metadata.requires("prefixroute") or []
    listed = set()
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        if f"extra == '{extra}'" in marker and "sys_platform" not in marker:
            dist = re.split(r"[<>=!~\[ ]", name.strip(), maxsplit=1)[0]
            listed.add(_IMPORT_NAMES.get(dist, dist))
    assert set(cli.EXTRA_MODULES[extra]) == listed
