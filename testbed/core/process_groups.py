"""Child processes stopped with everything they started, and SIGTERM taken as an interrupt.

Runs in any process that starts long-lived children: ``kvtb run`` (its cache servers, vLLM's
OpenAI servers), ``kvtb sweep``, ``kvtb bench``, ``kvtb chaos`` and the tests.

:func:`start_group` starts a child as the leader of a session of its own, hence of a process
group of its own: whatever it starts (vLLM's engine core and Python's resource tracker, say)
joins that group unless it makes one itself, and stays in it when the leader dies and the
member is reparented to init. A terminal's Ctrl-C reaches only the command in the
foreground, which then stops its children in order instead of all of them dying at once.
:func:`stop_group` stops the whole group:

1. SIGTERM to the leader, whose own shutdown stops what it started (vLLM's server closes its
   engine core and the connectors, which write their last spans);
2. up to ``timeout_s`` for the leader to exit, else SIGKILL to the group;
3. SIGTERM to the members still there (a child the leader left behind), a grace
   (:data:`STRAGGLER_GRACE_S`), then SIGKILL;
4. a wait until no member is left (zombies, which have exited, do not count), so that a caller
   about to remove files or to exit knows that nothing of the group runs.

An interrupt while it waits (a second Ctrl-C) kills the group at once, waits for it, and is
raised again: hurried, nothing is left behind either way. With ``die_with_parent`` the child
also gets SIGTERM when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``), so that
a starter killed by SIGKILL, which can clean nothing up, strands nothing: start such
children from a thread that outlives them (the main thread, in practice).

:func:`sigterm_as_interrupt` makes SIGTERM raise ``KeyboardInterrupt`` in the main thread, so
that ``kill`` or a batch scheduler stops a command as Ctrl-C does: through its context
managers, which stop its children, with exit code 130. Only the first SIGTERM interrupts;
later ones are ignored while that interrupt unwinds, so that they cannot cut a cleanup short.

:func:`watch_groups` tells a watcher of every group :func:`start_group` starts in this process
(a sweep's run tells the sweep, which can then stop them, :func:`stop_groups`, if it has to
stop the run before the run could stop them itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

STRAGGLER_GRACE_S = 5.0
"""How long members left behind by a leader that exited get after SIGTERM, before SIGKILL."""
_GONE_TIMEOUT_S = 10.0
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_prctl: Any = None
_group_watchers: list[Callable[[int], None]] = []
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after a fork


def start_group(
    command: Sequence[str], *, die_with_parent: bool = False, **popen: Any
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(command, **popen)`` as the leader of a new session and process
    group; with ``die_with_parent``, SIGTERM when the starting thread ends (module docstring)."""
    preexec = _terminate_with_parent if die_with_parent and _prctl is not None else None
    process = subprocess.Popen(list(command), start_new_session=True, preexec_fn=preexec, **popen)
    for watcher in _group_watchers:
        watcher(process.pid)
    return process


def watch_groups(watcher: Callable[[int], None]) -> None:
    """Calls ``watcher(group)`` for every group :func:`start_group` starts from now on in
    this process, as soon as it is started."""
    _group_watchers.append(watcher)


def stop_groups(groups: Iterable[int], grace_s: float = STRAGGLER_GRACE_S) -> None:
    """Stops every process of ``groups`` (their leaders' starter is gone: nobody else will):
    SIGTERM to each live group, up to ``grace_s`` for all to exit, SIGKILL to the rest, and a
    wait until none is left."""
    alive = [group for group in groups if group_members(group)]
    for group in alive:
        _signal(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for group in alive:
        if not _wait_empty(group, max(0.0, deadline - time.monotonic())):
            _signal(group, signal.SIGKILL)
            _wait_empty(group, _GONE_TIMEOUT_S)


def _terminate_with_parent() -> None:  # runs in the child, between fork and exec
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate_with_parent() -> None:
    """Asks Linux to SIGTERM this process when its parent dies (for a child forked by a
    multiprocessing fork server, which exits with the process that started it: a starter
    killed by SIGKILL strands nothing); exits at once if the parent is already gone."""
    if _prctl is None:
        return
    parent_pid = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid or parent_pid == 1:  # it died before prctl took effect
        raise SystemExit(1)


def stop_group(
    process: subprocess.Popen[Any], timeout_s: float, straggler_grace_s: float = STRAGGLER_GRACE_S
) -> None:
    """Stops ``process`` (started by :func:`start_group`) and every member of its group, as
    the module docstring says; returns once none is left."""
    group = process.pid
    try:
        if process.poll() is None:
            _signal(group, signal.SIGTERM, leader_only=True)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal(group, signal.SIGKILL)
                process.wait()
        if group_members(group):
            _signal(group, signal.SIGTERM)
            if not _wait_empty(group, straggler_grace_s):
                _signal(group, signal.SIGKILL)
        _wait_empty(group, _GONE_TIMEOUT_S)
    except KeyboardInterrupt:
        kill_group(process)
        raise


def kill_group(process: subprocess.Popen[Any]) -> None:
    """SIGKILL to ``process``'s whole group, as a crash would; returns once it is gone."""
    _signal(process.pid, signal.SIGKILL)
    process.wait()
    _wait_empty(process.pid, _GONE_TIMEOUT_S)


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """Each live process's ``(pid, fields of /proc/pid/stat after the command name)``: its
    state first, then its parent, then its process group; a process gone meanwhile is passed."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        yield int(entry.name), fields


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of process group ``group``, from ``/proc``."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return []  # the quick answer: no process at all, zombie or not
    except PermissionError:
        pass
    members = []
    for pid, fields in proc_stats():
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(pid)
    return members


def _signal(group: int, signum: int, *, leader_only: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leader_only:
            os.kill(group, signum)
        else:
            os.killpg(group, signum)


def _wait_empty(group: int, timeout_s: float) -> bool:
    """Waits until group ``group`` has no live member; False if some remain at the deadline."""
    deadline = time.monotonic() + timeout_s
    while group_members(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` in the main thread (once; later
    ones are ignored while it unwinds). Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = False

    def interrupt(signum: int, frame: object) -> None:
        nonlocal interrupted
        if interrupted:
            return
        interrupted = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
