"""``kvtb server``'s flags, generated from :class:`~server.config.ServerConfig`: one flag per
field (named by :func:`server.config.flag_name`), its docstring as the help, its default
shown; values are parsed into the config by :func:`config_from_args` with the field's type
(sizes such as ``512MiB`` for ``*_bytes`` fields), so that a bad value is an error naming its
flag and nothing else is repeated here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from server.config import ServerConfig, flag_name
from testbed.core import protocol as p
from testbed.core.sizes import format_bytes, parse_bytes
from testbed.core.typed_values import convert, field_docs, hints

GROUPS = {
    "deadlines (seconds)": lambda name: name.endswith("_s"),
    "limits (memory outside the pool, time per request)": lambda name: name.startswith(
        ("max_", "min_")
    ),
    "credentials": lambda name: name in ("token_file", "curve_dir"),
}
"""Help sections by field name (the rest: the server's main flags)."""
_CHOICES = {"pool_medium": p.POOL_MEDIA}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per :class:`ServerConfig` field, each parsed later (:func:`config_from_args`)."""
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    docs = field_docs(ServerConfig)
    defaults = ServerConfig()
    for name, annotation in hints(ServerConfig).items():
        group: Any = next((groups[t] for t, test in GROUPS.items() if test(name)), parser)
        help_text = _help(docs.get(name, ""), name, getattr(defaults, name))
        if name == "tiers":
            group.add_argument(
                flag_name(name), action="append", dest=name, metavar="TIER", help=help_text
            )
            continue
        if annotation is bool:
            group.add_argument(flag_name(name), action="store_true", dest=name, help=help_text)
            continue
        group.add_argument(
            flag_name(name),
            dest=name,
            default=None,
            choices=_CHOICES.get(name),
            metavar=None if name in _CHOICES else _metavar(name, annotation),
            help=help_text,
        )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The config the flags ask for (a flag left out keeps the field's default); a value that
    is not of its field's type raises ``ValueError`` naming the flag."""
    values: dict[str, Any] = {}
    for name, annotation in hints(ServerConfig).items():
        raw = getattr(args, name)
        if raw is None or raw is False:
            continue
        flag = flag_name(name)
        if name.endswith("_bytes"):
            try:
                values[name] = parse_bytes(raw)
            except ValueError as exc:
                raise ValueError(f"{flag} {raw!r}: {exc}") from None
        else:
            value = convert(raw, annotation, flag)
            values[name] = value.absolute() if isinstance(value, Path) else value
    return ServerConfig(**values)


def _help(doc: str, name: str, default: Any) -> str:
    """The field's docstring as help (first paragraph, without reST markup), and its default."""
    text = re.sub(r"``([^`]*)``", r"\1", doc.split("\n\n")[0]).replace("\n", " ")
    text = text.replace("%", "%%")
    if default is None or default is False:
        return text
    shown = format_bytes(default) if name.endswith("_bytes") and default else default
    return f"{text} (default: {shown})"


def _metavar(name: str, annotation: Any) -> str:
    if name.endswith("_bytes"):
        return "SIZE"
    if name.endswith("_s"):
        return "SECONDS"
    return "PATH" if Path in getattr(annotation, "__args__", (annotation,)) else name.upper()
