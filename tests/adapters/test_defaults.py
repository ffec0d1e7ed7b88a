"""Every adapter routes with the library's default policy unless told otherwise."""

from __future__ import annotations

import argparse
import inspect

import pytest

from prefixroute import Router
from prefixroute.adapters.proxy import cli as proxy_cli
from prefixroute.adapters.serve import cli as serve_cli


@pytest.mark.parametrize("module", [proxy_cli, serve_cli], ids=["proxy", "serve"])
def test_the_commands_default_to_the_routers_default_policy(module: object) -> None:
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers())  # type: ignore[attr-defined]
    (command,) = parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
    assert command.get_default("policy") == Router().policy.name


def test_the_ray_router_defaults_to_the_routers_default_policy() -> None:
    from prefixroute.adapters.ray import PrefixRouteRequestRouter  # the ray extra is part of the test extra

    default = inspect.signature(PrefixRouteRequestRouter.initialize_state).parameters["policy"].default
    assert default == Router().policy.name
