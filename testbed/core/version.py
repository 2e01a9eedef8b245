"""Which kvtestbed this is: the installed version and the git commit of its source.

The commit comes from the file a wheel or sdist build records (``testbed/core/_build_info.json``,
see ``setup.py``) or, for a source checkout or an editable install, from ``git`` in the
checkout the package lives in. ``None`` where neither says (e.g. a copy of the sources).
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

DISTRIBUTION = "kvtestbed"
BUILD_INFO = Path(__file__).resolve().parent / "_build_info.json"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def package_version() -> str | None:
    """The installed distribution's version, ``None`` when running from uninstalled sources."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def source_commit() -> dict[str, Any]:
    """``{"git_commit": str | None, "git_dirty": bool | None, "git_commit_from": "build" |
    "checkout" | None}``."""
    if BUILD_INFO.is_file():
        info = json.loads(BUILD_INFO.read_text())
        return {
            "git_commit": info.get("git_commit"),
            "git_dirty": info.get("git_dirty"),
            "git_commit_from": "build",
        }
    top = git_output("rev-parse", "--show-toplevel")
    commit = (
        git_output("rev-parse", "HEAD") if top and Path(top).resolve() == _PACKAGE_ROOT else None
    )
    if not commit:
        return {"git_commit": None, "git_dirty": None, "git_commit_from": None}
    status = git_output("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "git_commit_from": "checkout",
    }


def git_output(*args: str) -> str | None:
    """``git ARGS`` run in this package's source tree: its output, ``None`` if git is missing
    or fails (e.g. outside a checkout)."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=_PACKAGE_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
