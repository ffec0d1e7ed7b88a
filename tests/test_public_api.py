from __future__ import annotations

import ast
import importlib
import inspect
import re
import types
from collections.abc import Callable, Iterator
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


def test_package_ships_type_information() -> None:
    assert (Path(prefixroute.__file__).parent / "py.typed").exists()


CORE = ("_accounting", "_arguments", "_numbers", "errors", "hashing", "index", "policies", "router")


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


# Parameters with a default that may still be passed by position: the data a call is about, not a setting of it.
POSITIONAL_DATA = {
    # The block size every hash and index entry is counted in, what the object is made of: `PrefixIndex(16)`,
    # `EventIndex(16)`, `profile.kv_capacity_blocks(16)` (docs/api.md says so).
    "BlockHasher": "block_size",
    "PrefixIndex": "block_size",
    "EventIndex": "block_size",
    "EventsOnlyIndex": "block_size",
    "Profile.kv_capacity_blocks": "block_size",
    # The backend the request was sent to, commit's datum as route()'s backends are route()'s (None: the decided one).
    "Router.commit": "backend",
    # The backends to filter (None: every backend of the fleet), as route()'s backends.
    "Fleet.healthy_backends": "backends",
    # How many messages to lose: the call's one datum.
    "FakeVLLM.drop_next": "count",
}

# Records: values whose every field is data, built positionally like the tuples they are or read back from
# prefixroute (decisions, statistics, results, a trace's requests). A NamedTuple or a msgspec Struct (vLLM's event
# arrays, positional on the wire) is one by its type; these dataclasses are one by what they hold.
RECORDS = {
    "Decision", "BackendStats", "EngineMetrics", "TrackerStats", "CostCoefficients", "ModelSpec", "PolicyResult",
    "RequestRecord", "SimRequest", "CachedChain", "FakeRequest", "ProxyStats",
}  # fmt: skip


def _public_callables() -> Iterator[tuple[str, Callable[..., object]]]:
    """Every public class (its constructor, but an exception's: Python's), function and method reachable from the
    public ``__all__`` lists, named ``Class`` or ``Class.method``; methods that override a third-party base's
    (LiteLLM's or Ray's hook, whose signature that library fixes and calls) are left out."""
    import msgspec

    for package in ("prefixroute", *SUBPACKAGES):
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                yield name, obj
            if not inspect.isclass(obj):
                continue
            if not (issubclass(obj, (tuple, msgspec.Struct, BaseException)) or name in RECORDS):
                yield name, obj
            ours = [base for base in obj.__mro__ if base.__module__.startswith("prefixroute")]
            theirs = [base for base in obj.__mro__[1:] if base not in ours]
            for attribute in sorted({a for base in ours for a in vars(base) if not a.startswith("_")}):
                member = inspect.getattr_static(obj, attribute)
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) and not any(attribute in vars(base) for base in theirs):
                    yield f"{name}.{attribute}", member


def test_options_are_keyword_only() -> None:
    """A parameter with a default is a setting, passed by name (``stop(timeout=1)``, not ``stop(1)``), so a call
    reads as what it sets and a new option can be added anywhere; only :data:`POSITIONAL_DATA` is positional."""
    positional = []
    for name, function in _public_callables():
        for parameter in inspect.signature(function).parameters.values():
            option = parameter.default is not parameter.empty and POSITIONAL_DATA.get(name) != parameter.name
            if option and parameter.kind is not parameter.KEYWORD_ONLY:
                positional.append(f"{name}({parameter.name}=)")
    assert positional == []


def test_the_positional_exceptions_are_all_still_there() -> None:
    names = dict(_public_callables())
    for name, parameter in POSITIONAL_DATA.items():
        assert inspect.signature(names[name]).parameters[parameter].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    exported = {name for package in ("prefixroute", *SUBPACKAGES) for name in importlib.import_module(package).__all__}
    assert exported >= RECORDS


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_subpackage_name_is_used_by_some_test(package: str) -> None:
    sources = "\n".join(path.read_text() for path in (ROOT / "tests").rglob("*.py") if path.name != Path(__file__).name)
    unused = [name for name in importlib.import_module(package).__all__ if not re.search(rf"\b{name}\b", sources)]
    assert unused == [], f"{package} exports names no test uses"


def test_the_types_an_advertised_hook_hands_a_subclass_are_in_the_api_reference() -> None:
    """``PrefixIndex.evict`` (docs/internals.md's extension point) hands its override a store to evict from, through
    that store's methods: the store's class is part of the public API, documented where the hook is."""
    import typing

    reference = (ROOT / "docs" / "api.md").read_text()
    store = typing.get_type_hints(prefixroute.PrefixIndex.evict)["store"]
    assert f"::: {store.__module__}.{store.__qualname__}\n" in reference
    assert store.__qualname__ in importlib.import_module(store.__module__).__all__


_MUTABLE_BUILDERS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque"}


def _mutable_module_globals(source: str) -> list[str]:
    """The module-level names ``source`` binds to a new dict, list, set or other mutable container (``__all__``
    aside): state every user of the module would share."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [target.id for target in targets if isinstance(target, ast.Name) and target.id != "__all__"]
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call)
            and (value.func.id if isinstance(value.func, ast.Name) else getattr(value.func, "attr", None))
            in _MUTABLE_BUILDERS
        )
        if mutable:
            found.extend(names)
    return found


def test_the_rule_sees_each_kind_of_mutable_global() -> None:
    source = "__all__ = ['a']\na = {}\nb: list[int] = []\nc = collections.defaultdict(int)\nd = (1,)\ne = frozenset()\n"
    assert _mutable_module_globals(source) == ["a", "b", "c"]


def test_no_module_holds_mutable_state() -> None:
    """Module-level tables are read-only (``MappingProxyType``, ``frozenset``, tuples), so two routers, proxies or
    simulations in one process share nothing a caller could change."""
    root = Path(prefixroute.__file__).parent
    found = {
        f"{path.relative_to(root)}: {name}"
        for path in sorted(root.rglob("*.py"))
        for name in _mutable_module_globals(path.read_text())
    }
    assert not found
