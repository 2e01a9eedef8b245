"""Every flag of every ``kvtb`` command says what it does: the test walks each subcommand's
parser (``kvtb export jaeger`` included) and fails on a flag without a line of help, and checks
that a run key whose values are a closed set offers exactly that set."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from testbed.cli.kvtb import build_parser
from testbed.core.policies import POLICIES
from testbed.core.protocol import POOL_MEDIA
from testbed.core.telemetry.sampling import SAMPLERS
from testbed.fleet.routers import ROUTERS
from testbed.models.hardware import HARDWARE
from testbed.models.profiles import PROFILES
from testbed.spec.engines import ENGINE_NAMES, ORACLE_POLICIES
from testbed.spec.flag_table import SECTIONS

_NOT_FLAGS = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvtb",)
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser under ``parser`` (itself first), by its command line."""
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    yield from (a for a in parser._actions if not isinstance(a, _NOT_FLAGS))


COMMANDS = dict(parsers(build_parser()))


def test_the_walk_reaches_every_command():
    assert {"kvtb run", "kvtb server", "kvtb sweep", "kvtb whatif", "kvtb export jaeger"} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_line_of_help(command):
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in flags(COMMANDS[command])
        if not action.help or action.help.startswith("(default")
    ]
    assert not missing, f"{command}: flags without help: {missing}"


def _choices(command: str, flag: str) -> set[str]:
    action = next(a for a in flags(COMMANDS[command]) if flag in a.option_strings)
    return set(action.choices or ())


CLOSED_SETS = {
    "--engine": set(ENGINE_NAMES),
    "--servers": {"shared", "per-instance"},
    "--router": set(ROUTERS),
    "--policy": {*POLICIES, *ORACLE_POLICIES},
    "--tier-promote": {"none", "retain"},
    "--transfer-mode": {"worker", "server"},
    "--arrival": {"trace", "all"},
    "--pool-medium": set(POOL_MEDIA),
    "--time-profile": {"flat", *HARDWARE},
    "--profile": set(PROFILES),
    "--trace-sampler": set(SAMPLERS),
    "--time-model": {"none", "llama3-8b", "deepseek-mla"},
}


@pytest.mark.parametrize("flag", sorted(CLOSED_SETS))
def test_kvtb_run_offers_the_closed_sets_of_values(flag):
    assert _choices("kvtb run", flag) == CLOSED_SETS[flag]


def test_closed_sets_elsewhere():
    assert _choices("kvtb server", "--pool") == set(POOL_MEDIA)
    assert _choices("kvtb server", "--policy") == set(POLICIES)
    assert _choices("kvtb whatif", "--profile") == set(PROFILES)
    assert _choices("kvtb sweep", "--executor") == {"local", "ray"}


def test_a_value_outside_a_closed_set_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", "--servers", "each"])
    assert exit_.value.code == 2
    assert "invalid choice: 'each'" in capsys.readouterr().err


def test_kvtb_run_help_is_grouped_by_section():
    text = COMMANDS["kvtb run"].format_help()
    for title in SECTIONS:
        assert f"\n{title}:\n" in text
    listed = {
        group.title: {a.dest for a in group._group_actions}
        for group in COMMANDS["kvtb run"]._action_groups
    }
    assert {"servers", "router", "instances", "router_param"} <= listed["fleet"]
    assert {"trace_sampler", "otlp_endpoint"} <= listed["tracing"]
    assert {"capacity_bytes", "policy", "server"} <= listed["cache"]


def test_help_is_the_field_docstring():
    help_of = {
        a.dest: a.help for a in flags(COMMANDS["kvtb run"]) if a.dest in ("servers", "chunk_size")
    }
    assert help_of["servers"].startswith("fleet, and serve with --launch: one cache server for")
    assert "(default: 256)" in help_of["chunk_size"]
