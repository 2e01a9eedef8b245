"""Paths a user wrote, made absolute when they are read: relative to the working directory at
parse time (flags) or to a given base (a TOML file's directory), so no process later reads them
against its own working directory."""

from __future__ import annotations

import os
from pathlib import Path


def absolute_path(text: str | Path) -> Path:
    """A path flag as an absolute path, against the working directory at parse time
    (``type=absolute_path`` in argparse): no process later reads it against its own."""
    return absolute(Path(text).expanduser(), Path.cwd())


def absolute(path: Path, base: Path) -> Path:
    """``path`` made absolute against ``base``, ``..`` folded, symbolic links kept."""
    return Path(os.path.normpath(base / path))
