"""Declared bounds of configuration fields, checked in one place.

A config dataclass declares each field's bounds in its annotation, ``port: Annotated[int,
Bound(0, 65535)] = 5555`` (any :class:`FieldBound`: :class:`Bound` is a numeric range, workload
parameters add their own kinds), and its ``__post_init__`` calls :func:`bound_problems`, which
checks every field in field order and reports every problem at once. A :class:`Bound` refuses
floats that are not finite (``nan`` and ``inf``: a timeout of ``inf`` is a hang). The bounds
are data (:func:`field_bounds` lists a config's ranges as a table), so any parser (argparse,
TOML, ``msgspec.convert``) ends at the same check, and RELIABILITY.md can list them.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class FieldBound:
    """A check of one field, declared as an ``Annotated`` metadata item of its type."""

    def problem(self, label: str, value: Any, owner: object) -> str | None:
        """Why ``value``, of the field named ``label`` in messages, of config ``owner``, is
        out of bounds (``None``: it is not)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Bound(FieldBound):
    """``min <= value <= max`` (either end ``None``: open), in ``unit`` (for messages); a
    ``None`` value (absent) is not checked."""

    min: float | None
    max: float | None
    unit: str = ""

    def describe(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.min is not None and self.max is not None:
            return f"in [{_number(self.min)}, {_number(self.max)}]{unit}"
        if self.min is not None:
            return f"at least {_number(self.min)}{unit}"
        if self.max is not None:
            return f"at most {_number(self.max)}{unit}"
        return "a finite number"

    def problem(self, label: str, value: Any, owner: object) -> str | None:
        if value is None:
            return None
        problem = check(value, self)
        return None if problem is None else f"{label} {problem}, got {value!r}"


Declared = tuple[tuple[str, tuple[FieldBound, ...]], ...]
_DECLARED: dict[type, Declared] = {}


def declared_bounds(config_cls: type) -> Declared:
    """Each field of dataclass ``config_cls`` that declares bounds, with them, in field
    order (read once per class)."""
    declared = _DECLARED.get(config_cls)
    if declared is None:
        hints = typing.get_type_hints(config_cls, include_extras=True)
        declared = tuple(
            (field.name, bounds)
            for field in dataclasses.fields(config_cls)
            if (
                bounds := tuple(
                    item
                    for item in getattr(hints[field.name], "__metadata__", ())
                    if isinstance(item, FieldBound)
                )
            )
        )
        _DECLARED[config_cls] = declared
    return declared


def field_bounds(config_cls: type) -> dict[str, Bound]:
    """The numeric ranges ``config_cls`` declares, as a table ``{field: Bound}``."""
    return {
        name: bound
        for name, bounds in declared_bounds(config_cls)
        for bound in bounds
        if isinstance(bound, Bound)
    }


def bound_problems(config: object, label: Callable[[str], str] = str) -> list[str]:
    """One message per declared bound that a field of ``config`` (a dataclass) is outside, in
    field order. ``label`` names a field in messages (e.g. as its command-line flag)."""
    return [
        problem
        for name, bounds in declared_bounds(type(config))
        for bound in bounds
        if (problem := bound.problem(label(name), getattr(config, name), config)) is not None
    ]


def check(value: Any, bound: Bound) -> str | None:
    """Why ``value`` is outside ``bound`` (``None``: it is inside)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number {bound.describe()}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite and {bound.describe()}"
    if (bound.min is not None and value < bound.min) or (
        bound.max is not None and value > bound.max
    ):
        return f"must be {bound.describe()}"
    return None


def _number(value: float) -> str:
    if isinstance(value, int) and value >= 10_000:  # exactly: a float rounds 2^63 - 1 up
        if value & (value - 1) == 0:
            return f"2^{value.bit_length() - 1}"
        if value & (value + 1) == 0:
            return f"2^{value.bit_length()} - 1"
        return f"{value:,}"
    if float(value).is_integer() and abs(value) >= 10_000:
        exponent = math.log2(value) if value > 0 else 0.0
        if exponent.is_integer():
            return f"2^{int(exponent)}"
        return f"{int(value):,}"
    return f"{value:g}"
