"""``kvtb run``'s flags: every key of :class:`~testbed.spec.runspec.RunSpec` as a flag
(``--chunk-size`` for ``chunk_size``), a ``--config`` TOML file under them, and their parsing
into a validated spec. ``kvtb whatif`` takes the same flags for a workload source.

Paths are resolved as they are parsed (:mod:`testbed.spec.inputs`): a flag's relative to the
working directory, a ``--config`` file's relative to that file's directory."""

from __future__ import annotations

import argparse
import tomllib
import typing
from pathlib import Path
from typing import Any

from testbed.core.sizes import parse_bytes
from testbed.core.typed_values import convert, field_docs, help_line, means_absent
from testbed.spec.flag_table import SECTIONS, choices, section
from testbed.spec.inputs import (
    DATA_DIR_ENV,
    InputContext,
    data_dir,
    resolve_values,
    with_sampling_from_environment,
)
from testbed.spec.paths import absolute_path
from testbed.spec.runspec import DERIVED_KEYS, RunSpec

_PARAM_FLAGS = {
    "workload_params": ("--workload-param", "workload generator"),
    "router_params": ("--router-param", "router"),
}
"""Table-valued run keys: one repeatable ``KEY=VALUE`` flag each (``args.workload_param``)."""
_FIELD_DOCS = field_docs(RunSpec)
_DEFAULTS = RunSpec()


def add_spec_arguments(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``--config``, a flag per run key and ``--workload-param KEY=VALUE``, listed in the
    sections of :data:`~testbed.spec.flag_table.SECTIONS`; the sections by title (a command
    adds its own flags to them)."""
    parser.add_argument(
        "--config", type=absolute_path, help="TOML file with run keys (flags override it)"
    )
    add_data_dir_argument(parser)
    sections = {title: parser.add_argument_group(title) for title in SECTIONS}
    for name in RunSpec.keys():  # noqa: SIM118 (a classmethod, not a dict)
        if name not in DERIVED_KEYS:
            title = section(name)
            add_spec_flag(sections[title] if title else parser, name)
    return sections


def add_spec_flag(parser: Any, name: str) -> None:
    """The flag of run key ``name`` (``--chunk-size`` for ``chunk_size``): its field's docstring
    as its help, its default, and its choices where they are a closed set."""
    doc = help_line(_FIELD_DOCS.get(name, ""))
    if name in _PARAM_FLAGS:
        flag, what = _PARAM_FLAGS[name]
        parser.add_argument(
            flag,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"{doc} One {what} parameter, repeatable; VALUE is parsed as TOML.",
        )
        return
    if name == "tiers":  # one flag per tier, in order: --tier disk:8GiB:DIR --tier redis:4GiB
        parser.add_argument(
            "--tier",
            dest="tiers",
            action="append",
            default=None,
            metavar="KIND:CAPACITY[:WHERE]",
            help=doc + " Repeatable, in order below L1 (disk:8GiB:DIR, redis:4GiB).",
        )
        return
    flag = "--" + name.replace("_", "-")
    annotation = typing.get_type_hints(RunSpec)[name]
    default = getattr(_DEFAULTS, name)
    shown = "" if default is None else f" (default: {_as_typed(default)})"
    if annotation is bool:
        parser.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=None, help=doc + shown
        )
        return
    values = choices(name)
    if values is not None and type(None) in typing.get_args(annotation):
        values = (*values, "none")
    parser.add_argument(
        flag,
        default=None,
        choices=values,
        metavar=None if values else name.upper(),
        help=doc + shown,
    )


def _as_typed(value: Any) -> str:
    """A default as the user types it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def add_data_dir_argument(parser: argparse.ArgumentParser) -> None:
    """``--data-dir``: where ``$KVTB_DATA_DIR`` in a workload path points."""
    parser.add_argument(
        "--data-dir",
        type=absolute_path,
        default=None,
        help=f"the data directory of the public traces, $KVTB_DATA_DIR in a workload path "
        f"(default: {DATA_DIR_ENV}, else ../shared/data beside a checkout)",
    )


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE``: a run key set in every run of a sweep, over the sweep file."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a run key in every run, over the sweep file (VALUE as TOML; repeatable), "
        "e.g. --set requests=20 to try a sweep at a small size",
    )


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    data = data_dir(getattr(args, "data_dir", None))
    values: dict[str, Any] = {}
    if args.config is not None:
        config = Path(args.config).absolute()
        context = InputContext(config.parent, str(args.config), data)
        values.update(resolve_values(tomllib.loads(config.read_text()), context))
    flags: dict[str, Any] = {}
    hints = typing.get_type_hints(RunSpec)
    for name in RunSpec.keys():  # noqa: SIM118 (a classmethod, not a dict)
        raw = getattr(args, name, None)
        if raw is None or name in _PARAM_FLAGS:
            continue
        if isinstance(raw, list):  # a repeatable flag (--tier)
            flags[name] = raw
            continue
        flags[name] = raw if isinstance(raw, bool) else _parse_flag(name, raw, hints[name])
    if "workload" in flags:
        values.pop("workload_digest", None)  # the config's trace is not the one that runs
    values.update(resolve_values(flags, InputContext(Path.cwd(), "command line", data)))
    for name, (flag, _) in _PARAM_FLAGS.items():
        items = getattr(args, flag.removeprefix("--").replace("-", "_"), None) or []
        params = {**values.get(name, {}), **assignments(items)}
        if params:
            values[name] = params
    source = str(args.config) if args.config else "command line"
    return RunSpec.from_mapping(with_sampling_from_environment(values), source=source)


def asked_keys(args: argparse.Namespace) -> frozenset[str]:
    """The run keys the command line gives: its ``--config``'s keys and the flags set (what a
    run must not take from an external server instead)."""
    asked = set()
    if args.config is not None:
        asked |= set(tomllib.loads(Path(args.config).read_text()))
    for name in RunSpec.keys():  # noqa: SIM118 (a classmethod, not a dict)
        if name in _PARAM_FLAGS:
            flag = _PARAM_FLAGS[name][0].removeprefix("--").replace("-", "_")
            if getattr(args, flag, None):
                asked.add(name)
        elif getattr(args, name, None) is not None:
            asked.add(name)
    return frozenset(asked)


def assignments(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items as a mapping, each VALUE read as TOML (``20``, ``[32, 256]``,
    ``true``), or as a string where it is not TOML (``chat``); a bare ``KEY`` is ``true``."""
    values: dict[str, Any] = {}
    for item in items:
        key, equals, text = item.partition("=")
        if not equals:
            values[key] = True
            continue
        try:
            values[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            values[key] = text
    return values


def _parse_flag(name: str, raw: str, annotation: Any) -> Any:
    """A flag's text as its field's type (``none``/``unlimited``: ``None``; sizes for
    ``capacity_bytes``)."""
    if means_absent(raw, annotation):
        return None
    if name == "capacity_bytes":
        return parse_bytes(raw)
    expected = {int: "an integer", float: "a number"}
    wanted = next(
        (expected[t] for t in (int, float) if t in typing.get_args(annotation) or t is annotation),
        None,
    )
    flag = "--" + name.replace("_", "-")
    message = f"{flag} expects {wanted}, got {raw!r}" if wanted else None
    return convert(raw, annotation, flag, message=message)
