"""``kvtb run``'s flags: every key of :class:`~testbed.runspec.RunSpec` as a flag
(``--chunk-size`` for ``chunk_size``), a ``--config`` TOML file under them, and their parsing
into a validated spec. ``kvtb whatif`` takes the same flags for a workload source."""

from __future__ import annotations

import argparse
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from testbed.runspec import RunSpec
from testbed.sizes import parse_bytes

_PARAM_FLAGS = {
    "workload_params": ("--workload-param", "workload generator"),
    "router_params": ("--router-param", "router"),
}
"""Table-valued run keys: one repeatable ``KEY=VALUE`` flag each (``args.workload_param``)."""


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, a flag per run key and ``--workload-param KEY=VALUE``."""
    parser.add_argument("--config", type=Path, help="TOML file with run keys (flags override it)")
    hints = typing.get_type_hints(RunSpec)
    defaults = RunSpec()
    for name in RunSpec.keys():  # noqa: SIM118 (a classmethod, not a dict)
        if name in _PARAM_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        annotation = hints[name]
        default = getattr(defaults, name)
        if annotation is bool:
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"(default: {default})",
            )
            continue
        parser.add_argument(flag, default=None, metavar=name.upper(), help=f"(default: {default})")
    for flag, what in _PARAM_FLAGS.values():
        parser.add_argument(
            flag,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"a {what} parameter (repeatable; VALUE is parsed as TOML)",
        )


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(tomllib.loads(args.config.read_text()))
    hints = typing.get_type_hints(RunSpec)
    for name in RunSpec.keys():  # noqa: SIM118 (a classmethod, not a dict)
        raw = getattr(args, name, None)
        if raw is None or name in _PARAM_FLAGS:
            continue
        values[name] = raw if isinstance(raw, bool) else _parse_flag(name, raw, hints[name])
    for name, (flag, _) in _PARAM_FLAGS.items():
        params = dict(values.get(name, {}))
        for item in getattr(args, flag.removeprefix("--").replace("-", "_"), None) or []:
            key, _, value = item.partition("=")
            params[key] = tomllib.loads(f"v = {value}")["v"] if value else True
        if params:
            values[name] = params
    source = str(args.config) if args.config else "command line"
    return RunSpec.from_mapping(values, source=source)


def _parse_flag(name: str, raw: str, annotation: Any) -> Any:
    if raw.lower() in ("none", "unlimited"):
        return None
    options = (
        typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    )
    if name == "capacity_bytes":
        return parse_bytes(raw)
    if int in options:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(
                f"--{name.replace('_', '-')} expects an integer, got {raw!r}"
            ) from None
    if float in options:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')} expects a number, got {raw!r}") from None
    return raw
