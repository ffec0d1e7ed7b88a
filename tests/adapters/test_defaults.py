"""Every adapter routes with the library's default policy unless told otherwise."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

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


def test_each_default_of_serve_is_the_one_its_help_and_the_docs_state(capsys: pytest.CaptureFixture[str]) -> None:
    """``prefixroute serve --help`` and docs/adapters.md state the defaults an operator relies on (the port the
    gateway configs name, the lease that bounds a lost release, the body limit): the command takes those."""
    from prefixroute.cli import build_parser, main

    args, _ = build_parser().parse_known_args(["serve"])
    taken = (args.host, args.port, args.block_size, args.lease, args.max_body_mib, args.accel_redirect, args.log_level)
    assert taken == ("127.0.0.1", 8100, 16, 600.0, 32, "@prefixroute_upstream", "error")
    assert (args.backends, args.models, args.kv_events, args.ext_proc, args.release_port) == ([], None, [], None, None)
    given, _ = build_parser().parse_known_args(["serve", "--lease", "0.5", "--port", "0", "--ext-proc", "65535"])
    assert (given.lease, given.port, given.ext_proc) == (0.5, 0, 65535)  # the bounds' own values are taken
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for stated in ("(default 127.0.0.1)", "(default 8100;", "(default 16,", "(default 600)", "(default 32)",
                   "(default @prefixroute_upstream)", "(default error:"):  # fmt: skip
        assert stated in shown, stated
    docs = " ".join((Path(__file__).parents[2] / "docs" / "adapters.md").read_text().split())
    assert "(`--lease`, default 600 s;" in docs and "`--max-body-mib`, 32 MiB unless raised" in docs


def test_serve_takes_each_log_level_its_help_names() -> None:
    from prefixroute.cli import build_parser

    for level in ("debug", "info", "warning", "error"):
        args, _ = build_parser().parse_known_args(["serve", "--log-level", level])
        assert args.log_level == level


@pytest.mark.parametrize("level", ["verbose", "ERROR"])
def test_serve_refuses_another_log_level_with_one_line(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A level outside ``--log-level``'s choices would reach ``logging.setLevel``: a ValueError traceback."""
    from prefixroute.cli import main

    assert main(["serve", "--port", "0", "--log-level", level]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--log-level" in err and "Traceback" not in err, err
