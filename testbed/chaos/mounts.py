"""Small file systems in a private mount namespace: an exhausted ``/dev/shm`` or a full disk,
made without touching the machine's own.

Runs in the chaos process and in tests. ``unshare --mount`` gives a command its own copy of
the mount table (propagation private: nothing mounted in it is seen outside, nothing outside
changes); :func:`wrapper` mounts a tmpfs of a few MiB over ``/dev/shm`` or any directory in
it, then executes the command, whose children inherit the namespace. It needs Linux and the
right to make mount namespaces (root, or a user namespace): :func:`unavailable` says why it
cannot be done here (tests skip with that reason, ``kvtb chaos`` reports the scenario skipped).
:func:`fill` fills a file system to the last byte, as another process would.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Tmpfs:
    """A tmpfs of ``size_bytes`` mounted over ``path`` (an existing directory); ``full``:
    filled to the last byte (by a file ``.filler``) before the command starts."""

    path: Path
    size_bytes: int
    full: bool = False


def wrapper(mounts: Sequence[Tmpfs]) -> list[str]:
    """A command prefix that runs the rest of its arguments (in the same process, ``exec``) in
    a private mount namespace with ``mounts`` mounted."""
    steps = []
    for m in mounts:
        path = shlex.quote(str(m.path))
        steps.append(f"mount -t tmpfs -o size={m.size_bytes},mode=1777 kvtb-chaos {path}")
        if m.full:
            steps.append(f"{{ dd if=/dev/zero of={path}/.filler bs=4k 2>/dev/null || true; }}")
    script = " && ".join([*steps, 'exec "$0" "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


@functools.cache
def unavailable() -> str | None:
    """Why private mounts cannot be made here (``None``: they can)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux with unshare(1) (util-linux)"
    with tempfile.TemporaryDirectory() as directory:
        try:
            done = subprocess.run(
                [*wrapper([Tmpfs(Path(directory), 1 << 20)]), "true"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unshare --mount failed: {exc}"
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"cannot make a private mount namespace here (root needed): {detail[0]}"
    return None


def run_python(
    mounts: Sequence[Tmpfs],
    *args: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs ``python ARGS`` (``-c CODE``, ``-m MODULE ...``) from the repository root with
    ``mounts`` in place; its output is captured."""
    return subprocess.run(
        [*wrapper(mounts), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def fill(directory: Path, name: str = "filler") -> int:
    """Writes ``directory/name`` until its file system is full; returns the bytes written."""
    block = b"\xa5" * (1 << 16)
    written = 0
    with open(Path(directory) / name, "ab", buffering=0) as filler:
        try:
            while True:
                written += filler.write(block)
        except OSError:
            pass
    small = block[:512]
    with open(Path(directory) / f"{name}.tail", "ab", buffering=0) as tail:
        try:
            while True:
                written += tail.write(small)
        except OSError:
            pass
    return written
