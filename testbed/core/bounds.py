"""Declared ranges of configuration fields, checked in one place.

A config type lists its numeric fields in a table ``{field: Bound(min, max, unit)}``; its
``__post_init__`` calls :func:`out_of_bounds` and reports every problem at once. Floats must
also be finite (``nan`` and ``inf`` are refused: a timeout of ``inf`` is a hang). The tables
are data, so any parser (argparse, TOML, ``msgspec.convert``) ends at the same check, and
RELIABILITY.md can list them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


class Bound(NamedTuple):
    """``min <= value <= max`` (either end ``None``: open), in ``unit`` (for messages)."""

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


def out_of_bounds(
    values: object, table: Mapping[str, Bound], label: Callable[[str], str] = str
) -> list[str]:
    """One message per field of ``values`` (an object with those attributes) outside its
    bound; ``None`` values are not checked (absent). ``label`` names a field in messages
    (e.g. as its command-line flag)."""
    problems = []
    for name, bound in table.items():
        value = getattr(values, name)
        if value is None:
            continue
        problem = check(value, bound)
        if problem is not None:
            problems.append(f"{label(name)} {problem}, got {value!r}")
    return problems


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
    if float(value).is_integer() and abs(value) >= 10_000:
        exponent = math.log2(value) if value > 0 else 0.0
        if exponent.is_integer():
            return f"2^{int(exponent)}"
        return f"{int(value):,}"
    return f"{value:g}"
