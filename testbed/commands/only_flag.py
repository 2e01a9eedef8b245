"""``--only NAME`` (repeatable): a command that runs named parts in order (bench sections,
chaos scenarios) runs only those named, still in their order."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def add_only_argument(parser: Any, names: Iterable[str], part: str) -> None:
    """Adds ``--only`` to ``parser`` (an ``argparse`` parser), its choices ``names``;
    ``part`` is what one of them is, for the help text."""
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(names),
        help=f"run only this {part} (repeatable)",
    )


def picked(names: Iterable[str], only: list[str] | None) -> list[str]:
    """``names`` in their order, only those in ``only`` (``None`` or empty: all of them)."""
    return [name for name in names if not only or name in only]
