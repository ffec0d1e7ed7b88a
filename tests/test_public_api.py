from __future__ import annotations

import inspect
import types
from pathlib import Path

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
