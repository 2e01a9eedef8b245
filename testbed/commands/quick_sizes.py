"""Sizes of a command that has a quick and a full run (``kvtb bench``, ``kvtb chaos``),
declared once each: ``rounds = QuickOrFull(3, 30)`` on a config with a ``quick`` flag reads 3
on a quick config and 30 on a full one."""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar, overload

T = TypeVar("T")


class HasQuick(Protocol):
    """A config with a ``quick`` flag (small sizes everywhere)."""

    @property
    def quick(self) -> bool: ...


class QuickOrFull(Generic[T]):
    """A class attribute of a config whose value is ``quick`` on a quick config, else
    ``full`` (a descriptor: not a dataclass field, so not a setting of its own)."""

    def __init__(self, quick: T, full: T) -> None:
        self.quick = quick
        self.full = full

    @overload
    def __get__(self, config: None, owner: Any) -> QuickOrFull[T]: ...

    @overload
    def __get__(self, config: HasQuick, owner: Any) -> T: ...

    def __get__(self, config: HasQuick | None, owner: Any) -> QuickOrFull[T] | T:
        if config is None:
            return self
        return self.quick if config.quick else self.full
