from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

import prefixroute

ROOT = Path(__file__).resolve().parents[1]


def test_all_matches_the_public_names() -> None:
    public = {
        name
        for name, value in vars(prefixroute).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }
    assert public | {"__version__"} == set(prefixroute.__all__)
    assert len(prefixroute.__all__) == len(set(prefixroute.__all__))


def test_every_public_name_is_documented_and_in_the_api_reference() -> None:
    reference = (ROOT / "docs" / "api.md").read_text()
    for name in prefixroute.__all__:
        if name == "__version__":
            continue
        obj = getattr(prefixroute, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"
        assert f"`{name}`" in reference or f"::: prefixroute.{name}\n" in reference, f"{name} missing from docs/api.md"


def test_options_are_keyword_only() -> None:
    for cls in (prefixroute.Router,):
        for parameter in list(inspect.signature(cls).parameters.values()):
            assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, (cls, parameter)
    for with_block_size in (prefixroute.BlockHasher, prefixroute.PrefixIndex):
        options = list(inspect.signature(with_block_size).parameters.values())[1:]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in options), with_block_size


def test_package_ships_type_information() -> None:
    assert (Path(prefixroute.__file__).parent / "py.typed").exists()


CORE = ("_numbers", "errors", "hashing", "index", "policies", "router")


def test_core_modules_import_nothing_above_them() -> None:
    """The decision core imports no layer above it: not vllm/, sim/, adapters/ or testing/."""
    import ast

    for name in CORE:
        tree = ast.parse((ROOT / "prefixroute" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                if module.startswith("prefixroute."):
                    assert module.removeprefix("prefixroute.") in CORE, f"{name}.py imports {module}"


def test_every_public_name_is_used_by_some_test() -> None:
    sources = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("*.py") if path.name != Path(__file__).name)
    for name in prefixroute.__all__:
        if name != "__version__":
            assert name in sources, f"{name} is exported but no test uses it"


# The public subpackages: each one's ``__all__`` is held to the standard of ``prefixroute.__all__``.
SUBPACKAGES = (
    "prefixroute.vllm",
    "prefixroute.sim",
    "prefixroute.adapters.proxy",
    "prefixroute.adapters.serve",
    "prefixroute.adapters.tokenize",
    "prefixroute.adapters.litellm",
    "prefixroute.adapters.ray",
    "prefixroute.testing",
)


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_subpackage_name_is_documented_and_in_the_api_reference(package: str) -> None:
    module = importlib.import_module(package)
    reference = (ROOT / "docs" / "api.md").read_text()
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        obj = getattr(module, name)  # a lazily imported name resolves too
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{package}.{name} has no docstring"
        assert f"::: {package}.{name}\n" in reference, f"{package}.{name} missing from docs/api.md"


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_subpackage_name_is_used_by_some_test(package: str) -> None:
    sources = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("*.py") if path.name != Path(__file__).name)
    unused = [name for name in importlib.import_module(package).__all__ if not re.search(rf"\b{name}\b", sources)]
    assert unused == [], f"{package} exports names no test uses"
