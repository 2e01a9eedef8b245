"""Workload parameter dataclasses: their bounds, declared once, and parsing a mapping into one.

A workload's parameters are a frozen dataclass deriving from :class:`WorkloadParams`; each
field that has a bound carries it in its annotation (``turns: Annotated[int, AtLeast(1)] = 4``),
as every config does (:mod:`testbed.core.bounds`); the bounds here are the kinds workload
parameters need. The one ``__post_init__`` checks every field against its bounds, in field
order, and raises one ValueError ``invalid {workload} params: ...`` that lists every problem.
:func:`parse_params` makes one from a mapping (a TOML table, CLI ``key=value`` pairs), coercing
text to the types.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from testbed.core.bounds import FieldBound, bound_problems
from testbed.core.typed_values import convert


@dataclass(frozen=True)
class AtLeast(FieldBound):
    """A number ``>= minimum``, or ``None`` (absent)."""

    minimum: float

    def problem(self, label: str, value: Any, owner: object) -> str | None:
        if value is not None and not value >= self.minimum:
            return f"{label} must be >= {self.minimum}, got {value}"
        return None


@dataclass(frozen=True)
class Range(FieldBound):
    """An inclusive ``(min, max)`` pair with ``minimum <= min <= max``."""

    minimum: int

    def problem(self, label: str, value: Any, owner: object) -> str | None:
        low, high = value
        if low < self.minimum or high < low:
            return (
                f"{label} must be a [min, max] pair with {self.minimum} <= min <= max, "
                f"got {list(value)}"
            )
        return None


@dataclass(frozen=True)
class NotAbove(FieldBound):
    """A number no larger than the field ``other`` of the same parameters."""

    other: str

    def problem(self, label: str, value: Any, owner: object) -> str | None:
        limit = getattr(owner, self.other)
        if value > limit:
            return f"{label} ({value}) must not exceed {self.other} ({limit})"
        return None


@dataclass(frozen=True)
class Rate(FieldBound):
    """A Poisson arrival rate: ``> 0``, ``inf`` putting every request at time 0."""

    def problem(self, label: str, value: Any, owner: object) -> str | None:
        if not value > 0:
            return f"{label} must be > 0 (inf: all at time 0), got {value}"
        return None


class WorkloadParams:
    """Base of a workload's parameter dataclass (``class P(WorkloadParams, workload="chat")``).

    Construction checks every field against the :class:`FieldBound` items of its
    ``Annotated`` type, in field order, and raises ValueError ``invalid {workload} params:``
    followed by every problem, ``; ``-separated.
    """

    _workload: typing.ClassVar[str]

    def __init_subclass__(cls, *, workload: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._workload = workload

    def __post_init__(self) -> None:
        problems = bound_problems(self)
        if problems:
            raise ValueError(f"invalid {self._workload} params: " + "; ".join(problems))


def parse_params(params_cls: type[Any], values: Mapping[str, object] | None, workload: str) -> Any:
    """``params_cls(**values)`` after checking keys and coercing values to the field types.

    Unknown keys and uncoercible values raise ValueError naming the key and the valid keys;
    ranges and bounds are then checked by ``params_cls.__post_init__``.
    """
    fields = {field.name: field for field in dataclasses.fields(params_cls)}
    hints = typing.get_type_hints(params_cls)
    kwargs: dict[str, object] = {}
    for key, value in (values or {}).items():
        if key not in fields:
            valid = ", ".join(fields) or "(none)"
            raise ValueError(f"unknown {workload} param {key!r}; valid params: {valid}")
        kwargs[key] = _coerce(f"{workload} param {key!r}", value, hints[key])
    return params_cls(**kwargs)


def _coerce(what: str, value: object, hint: Any) -> object:
    """``value`` as ``hint`` (:func:`testbed.core.typed_values.convert`, text read as the type):
    ``"none"`` is ``None`` for an optional field, ``"a,b"`` a pair."""
    optional = type(None) in typing.get_args(hint)
    if optional and isinstance(value, str) and value.lower() == "none":
        return None
    options = typing.get_args(hint) if optional else (hint,)
    if any(typing.get_origin(option) is tuple for option in options) and isinstance(value, str):
        value = value.split(",")
    return convert(value, hint, what)
