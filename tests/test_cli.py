from __future__ import annotations

import importlib
import sys
from types import ModuleType

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
