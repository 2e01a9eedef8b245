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
from testbed.core.typed_values import convert
from testbed.spec.inputs import (
    DATA_DIR_ENV,
    InputContext,
    data_dir,
    resolve_values,
    with_sampling_from_environment,
)
from testbed.spec.paths import absolute_path
from testbed.spec.runspec import DERIVED_KEYS, NAMED_NONE_KEYS, RunSpec

_PARAM_FLAGS = {
    "workload_params": ("--workload-param", "workload generator"),
    "router_params": ("--router-param", "router"),
}
"""Table-valued run keys: one repeatable ``KEY=VALUE`` flag each (``args.workload_param``)."""


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, a flag per run key and ``--workload-param KEY=VALUE``."""
    parser.add_argument(
        "--config", type=absolute_path, help="TOML file with run keys (flags override it)"
    )
    add_data_dir_argument(parser)
    hints = typing.get_type_hints(RunSpec)
    defaults = RunSpec()
    for name in RunSpec.keys():  # noqa: SIM118 (a classmethod, not a dict)
        if name in _PARAM_FLAGS or name in DERIVED_KEYS:
            continue
        flag = "--" + name.replace("_", "-")
        annotation = hints[name]
        default = getattr(defaults, name)
        if name == "tiers":
            parser.add_argument(
                "--tier",
                dest="tiers",
                action="append",
                default=None,
                metavar="KIND:CAPACITY[:WHERE]",
                help="a tier below the cache server's L1 (repeatable, in order; disk:8GiB:DIR)",
            )
            continue
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
    if raw.lower() in ("none", "unlimited") and name not in NAMED_NONE_KEYS:
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
