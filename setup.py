"""Build step that records which commit a distribution was built from.

Everything else about the package is in pyproject.toml. A wheel or sdist built from a git
checkout carries ``testbed/core/_build_info.json`` (``{"git_commit": ..., "git_dirty": ...}``), so
that ``env.json`` of a run names the source of an installed copy too (:mod:`testbed.core.version`).
A wheel built from an sdist keeps the sdist's record. Editable installs write nothing: they
read the checkout's commit at run time.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
BUILD_INFO = Path("testbed") / "core" / "_build_info.json"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _build_info() -> dict[str, object] | None:
    """The checkout's commit, or ``None`` outside one (e.g. building from an unpacked sdist)."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != ROOT:
        return None  # not a checkout of this project (maybe inside another repository)
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def _write(directory: Path) -> None:
    info = _build_info()
    if info is not None:
        path = directory / BUILD_INFO
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info) + "\n")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            _write(Path(self.build_lib))


class Sdist(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _write(Path(base_dir))


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
