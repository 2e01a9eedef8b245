"""What tests started and left behind: processes, files in ``/dev/shm``, and the private
directories launched vLLM servers keep their IPC sockets in (``testbed.engine.rpc_dir``, in the
temp directory).

A process started with a marker variable in its environment (:data:`MARKER` for the session,
:data:`CASE_MARKER` for one test) passes it on to everything it starts, and keeps it when it
is reparented to init: vLLM's engine core, a run's cache server, a sweep's run processes. A
:class:`Tracker` samples ``/proc`` for them and remembers each one it saw (pid and start
time), and the process group of each that leads a group of its own (``start_group``): a
process that rewrites its title (``setproctitle``, as vLLM's engine core and workers do) can
no longer show its environment, but it is still the process seen, and what it starts after
that stays in its group. Its :meth:`~Tracker.alive` is every live process (zombies have exited)
that carries the marker, was seen, or belongs to a group seen, the caller aside.

:class:`Census` is the session's (``tests/conftest.py``): a thread samples every
:data:`SAMPLE_S`, notes the test running when each process appeared, and
:meth:`Census.leftovers` says at the end what is still there: the live processes, and the
entries of ``/dev/shm`` that were not there at the start and are named for a process seen
(kvtb's pools, token files and shared KV files end in ``<pid>-<hex>``: ``server.reclaim``) or
are open or mapped by one still alive, and likewise the temp directory's new
``kvtb-vllm-rpc-<pid>-<hex>`` directories. :class:`CaseWatch` is one test's, sampled when the test
asks. Other users' processes and files are never counted: the machine may be shared.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "KVTB_TEST_MARKER"
"""Environment variable whose value names the test session a process belongs to."""
CASE_MARKER = "KVTB_TEST_CASE"
"""One a test sets for the processes it starts, to find them apart from the session's others."""
SAMPLE_S = 0.25
SHM = Path("/dev/shm")
RPC_DIRS = (Path(tempfile.gettempdir()), "kvtb-vllm-rpc-")
"""Where launched vLLM servers' socket directories are, and how their names start."""
_OWNED_NAME = re.compile(r"-(\d+)-[0-9a-f]{8,}(?:\.json)?$")


@dataclass(frozen=True)
class Proc:
    """One live process, as ``/proc`` shows it."""

    pid: int
    ppid: int
    pgid: int
    start_ticks: int
    """When it started (``/proc/PID/stat`` field 22): a pid used again is another process."""
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}, group {self.pgid}): {self.cmdline[:160]}"


def read_proc(pid: int) -> Proc | None:
    """``pid`` as ``/proc`` shows it; ``None`` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return Proc(pid, int(fields[1]), int(fields[2]), int(fields[19]), command)


def has_marker(pid: int, name: str, value: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return f"{name}={value}".encode() in environ.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


class Tracker:
    """The processes carrying ``name=value``, as seen by :meth:`sample` (module docstring)."""

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value
        self.seen: dict[int, Proc] = {}
        self.groups: set[int] = set()
        """Process groups led by a marked process (not the caller's own group)."""
        self._own_group = os.getpgid(0)
        self._checked: set[int] = set()
        """Pids whose environment was read (read once each while they live)."""

    def sample(self) -> list[Proc]:
        """Notes the marked processes that appeared since the last sample; returns them."""
        current = pids()
        self._checked &= set(current)  # a pid that went may come back as someone else's
        found = []
        for pid in current:
            if pid in self._checked:
                continue
            self._checked.add(pid)
            if has_marker(pid, self.name, self.value) and (proc := read_proc(pid)) is not None:
                self._note(proc)
                found.append(proc)
        return found

    def _note(self, proc: Proc) -> None:
        self.seen.setdefault(proc.pid, proc)
        if proc.pgid == proc.pid and proc.pgid != self._own_group:
            self.groups.add(proc.pgid)

    def alive(self) -> list[Proc]:
        """Every live process that is marked, was seen, or is in a group seen; not ours."""
        self.sample()
        found = []
        for pid in pids():
            proc = read_proc(pid)
            if proc is None or pid == os.getpid():
                continue
            before = self.seen.get(pid)
            if (
                (before is not None and before.start_ticks == proc.start_ticks)
                or proc.pgid in self.groups
                or has_marker(pid, self.name, self.value)
            ):
                self._note(proc)
                found.append(proc)
        return found


def held_files(pids: Iterable[int], under: Path = SHM) -> set[Path]:
    """Files under ``under`` that ``pids`` have open or mapped."""
    found: set[Path] = set()
    prefix = f"{under}/"
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(prefix):
                    found.add(Path(parts[5].removesuffix(" (deleted)")))
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    found.add(Path(target.removesuffix(" (deleted)")))
        except OSError:
            continue
    return {path for path in found if path.exists()}


def files_named_for(pids: Iterable[int], paths: Iterable[Path]) -> set[Path]:
    """Of ``paths``, those named for one of ``pids`` (``...-<pid>-<hex>``)."""
    wanted = set(pids)
    found = set()
    for path in paths:
        match = _OWNED_NAME.search(path.name)
        if match is not None and int(match.group(1)) in wanted:
            found.add(path)
    return found


def watched_entries() -> set[Path]:
    """Every entry of ``/dev/shm``, and the temp directory's vLLM socket directories."""
    rpc_under, rpc_prefix = RPC_DIRS
    return {SHM / name for name in _listdir(SHM)} | {
        rpc_under / name for name in _listdir(rpc_under) if name.startswith(rpc_prefix)
    }


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@dataclass
class Leftovers:
    processes: list[Proc] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    seen_in: dict[int, str] = field(default_factory=dict)
    """Pid → the test during which it was first seen."""

    def __bool__(self) -> bool:
        return bool(self.processes or self.files)

    def report(self) -> str:
        lines = [f"the test session left {len(self.processes)} processes running:"]
        lines += [
            f"  {p.describe()} [appeared during {self.seen_in.get(p.pid, '?')}]"
            for p in self.processes
        ]
        lines.append(f"and {len(self.files)} files it made in {SHM} or vLLM socket directories:")
        lines += [f"  {path}" for path in self.files]
        return "\n".join(lines)


def _left_files(
    tracker: Tracker, alive: list[Proc], at_start: set[Path], *, own: bool = False
) -> set[Path]:
    """Entries new in the watched places (:func:`watched_entries`) named for a process seen
    (``own``: or for this one), or held by one alive."""
    new = watched_entries() - at_start
    held = {path for path in held_files(p.pid for p in alive) if path in new}
    named = [*tracker.seen, *([os.getpid()] if own else [])]
    return files_named_for(named, new) | held


class Census:
    """The session's watch over ``MARKER=value`` (module docstring). Start it before anything
    is started with the marker; :meth:`leftovers` stops it."""

    def __init__(self, value: str) -> None:
        self.tracker = Tracker(MARKER, value)
        self.current = "(session start)"
        """The test running now (the conftest sets it), to name where a leak came from."""
        self.seen_in: dict[int, str] = {}
        self._at_start = watched_entries()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="leak-census", daemon=True)

    def start(self) -> Census:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        for proc in self.tracker.sample():
            self.seen_in.setdefault(proc.pid, self.current)

    def leftovers(self) -> Leftovers:
        """What is still there now, of what the marked processes started."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()
        alive = self.tracker.alive()
        files = _left_files(self.tracker, alive, self._at_start, own=True)
        return Leftovers(alive, sorted(files), dict(self.seen_in))


class CaseWatch:
    """The processes one test starts, marked ``CASE_MARKER=<a value of its own>``: noted while
    they run (:meth:`note`, with the ``/dev/shm`` files they hold), and none of them or their
    files may be left once the test says they should be gone (:meth:`assert_nothing_left`).
    The test passes :attr:`env` to what it starts (or sets it in its own environment)."""

    def __init__(self) -> None:
        self.tracker = Tracker(CASE_MARKER, secrets.token_hex(8))
        self.files: set[Path] = set()
        self._at_start = watched_entries()

    @property
    def env(self) -> dict[str, str]:
        return {CASE_MARKER: self.tracker.value}

    @property
    def seen(self) -> dict[int, Proc]:
        return self.tracker.seen

    def note(self) -> list[Proc]:
        """The live processes of the test (their latest titles), noted with the files they
        hold now."""
        alive = self.tracker.alive()
        self.files |= held_files(proc.pid for proc in alive)
        return alive

    def assert_nothing_left(self) -> None:
        alive = self.tracker.alive()
        files = {p for p in self.files if p.exists()}
        files |= _left_files(self.tracker, alive, self._at_start)
        assert not alive and not files, "left behind: " + "; ".join(
            [proc.describe() for proc in alive] + [str(path) for path in files]
        )
