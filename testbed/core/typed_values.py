"""User values as typed fields: one parser for every config, flag and TOML file.

``msgspec.convert`` does the conversion (``strict=False`` for text, where ``"1"``, ``"true"``
and ``"2.0"`` are read as the field's type; strict for typed sources such as TOML); this module
only names the key in the error and reads the field docstrings that configs keep under each
field (the help text of generated flags).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec


def convert(
    value: Any, annotation: Any, what: str, *, strict: bool = False, message: str | None = None
) -> Any:
    """``value`` as a value of ``annotation``; ``ValueError`` ``"{what}: cannot use {value!r}
    as {type}"`` (or ``message``) when it is not one (``strict``: no conversion from text)."""
    try:
        if _is_path(annotation) and isinstance(value, str | Path):
            return Path(value)
        return msgspec.convert(value, annotation, strict=strict)
    except msgspec.ValidationError:
        problem = f"{what}: cannot use {value!r} as {type_name(annotation)}"
        raise ValueError(message or problem) from None


def _is_path(annotation: Any) -> bool:
    return Path in _options(annotation)


def _options(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def type_name(annotation: Any) -> str:
    """``int``, ``bool or None``, ``one of 'shm', 'disk'``: an annotation as a user reads it."""
    names = []
    for option in _options(annotation):
        if option is type(None):
            names.append("None")
        elif typing.get_origin(option) is typing.Literal:
            names.append("one of " + ", ".join(map(repr, typing.get_args(option))))
        else:
            names.append(getattr(option, "__name__", str(option)))
    return " or ".join(names)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (fields without one: absent)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def help_line(doc: str) -> str:
    """A field's docstring as the one line of help of its flag: its first paragraph, joined,
    without reST markup, ``%`` escaped for argparse."""
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", doc.split("\n\n")[0])
    text = re.sub(r"``([^`]*)``", r"\1", text)
    return " ".join(text.split()).replace("%", "%%")


def hints(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of dataclass ``cls``."""
    resolved = typing.get_type_hints(cls)
    return {f.name: resolved[f.name] for f in dataclasses.fields(cls)}


def means_absent(text: str, annotation: Any) -> bool:
    """Whether ``text`` (``none``, ``unlimited``) is the absent value of a key of type
    ``annotation``: only where the key may be None (a capacity); elsewhere ``none`` is a
    value's name (``tier_promote``)."""
    return text.lower() in ("none", "unlimited") and type(None) in typing.get_args(annotation)


def literal_problems(value: Any) -> list[str]:
    """The fields of a closed set (a ``Literal``) of dataclass ``value`` holding a value outside
    it: a value made by its constructor is checked as ``msgspec.convert`` checks one it
    converts."""
    problems = []
    for name, annotation in hints(type(value)).items():
        if typing.get_origin(annotation) is Literal:
            options = typing.get_args(annotation)
            held = getattr(value, name)
            if held not in options:
                listed = ", ".join(map(str, options))
                problems.append(f"{name} must be one of {listed}, got {held!r}")
    return problems
