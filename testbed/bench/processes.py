"""The bench's engine and peer processes: started in sessions of their own, stopped with
everything they started, and the shared-memory files they used removed after them.

LMCache's server and the engines beside it create shared-memory files under ``/dev/shm``
whose names we do not choose (and a killed LMCache server leaves them behind). A
:class:`BenchProcesses` notes, while its processes run, every ``/dev/shm`` file any of them
(or their descendants) has mapped or open; :meth:`BenchProcesses.close` stops the process
groups (SIGINT, then SIGKILL) and removes those files. Only files seen in use by our own
processes are removed: the machine's other users' files are never touched. Linux only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from testbed.core.closing import Closing

SHM = Path("/dev/shm")


class BenchProcesses(Closing):
    """Context manager holding the bench's processes; closed on exit, Ctrl-C included."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[str]] = []
        self.shm_files: set[Path] = set()
        self._logs: list[object] = []

    def start(
        self,
        command: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        *,
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | None = None,
    ) -> subprocess.Popen[str]:
        """Starts ``command`` in a session of its own, stderr (and stdout unless piped) to
        ``log_path``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("a")
        self._logs.append(log)
        process = subprocess.Popen(
            list(command),
            stdin=stdin,
            stdout=stdout if stdout is not None else log,
            stderr=log,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def note_shm_files(self) -> None:
        """Remembers the ``/dev/shm`` files our processes and their descendants use now."""
        for pid in _descendants({p.pid for p in self.processes if p.poll() is None}):
            self.shm_files |= _shm_files_of(pid)

    def close(self, timeout_s: float = 15.0) -> None:
        """Stops every process group (SIGINT, then SIGKILL after ``timeout_s``) and removes
        the shared-memory files they used."""
        self.note_shm_files()
        groups = [p.pid for p in self.processes]
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
        for group in groups:  # whatever is left of each group, children included
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        for process in self.processes:
            process.wait()
        for path in self.shm_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for log in self._logs:
            log.close()  # type: ignore[attr-defined]


def _descendants(roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _shm_files_of(pid: int) -> set[Path]:
    """``/dev/shm`` files ``pid`` has mapped or open."""
    found: set[Path] = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith(f"{SHM}/"):
                found.add(Path(path.removesuffix(" (deleted)")))
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith(f"{SHM}/"):
                    found.add(Path(target.removesuffix(" (deleted)")))
    return found
