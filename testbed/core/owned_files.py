"""Files a process owns for its lifetime: space reserved when made, liveness by advisory lock.

A cache server's pool and token file, and a worker's shared KV file, live in ``/dev/shm`` (or
a directory given) where other processes, and processes of other PID namespaces (containers
sharing ``/dev/shm``), can see them. Two promises hold for them:

- **Their space is there.** :func:`create_reserved` allocates every byte of the file when it
  is made (``posix_fallocate``; on tmpfs that allocates the pages), so no later write into a
  mapping of it can fault for want of memory or disk (``SIGBUS``); a file that does not fit
  is refused with :class:`InsufficientSpace`, whose message names the size and what is free.
- **Their owner's liveness is the lock, not the pid.** The owner holds a shared ``flock`` on
  the file from before the file has its name until it exits (:class:`OwnerLock`; the kernel
  drops the lock with the last descriptor, however the owner dies). A file whose lock anyone
  can take exclusively has no owner left: :func:`remove_if_abandoned` removes it. ``flock``
  locks belong to the open file, not to a pid, so they mean the same in every PID namespace
  that sees the file; a pid in a file name is only a label for people.

A file gets its final name only once it is locked (made under a temporary name, locked, then
renamed), so no reclaimer can see a final name without a live lock behind it. Names end in
``<pid>-<16 hex digits>`` (:func:`owned_name`); earlier versions' owners, which hold no lock,
used 8 hex digits, and such a file is taken as live while its pid runs here
(:func:`remove_if_abandoned`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
from pathlib import Path

from testbed.core.sizes import format_bytes

log = logging.getLogger(__name__)

_ZEROS = 1 << 20


class InsufficientSpace(ValueError):
    """A file's space could not be reserved (``ENOSPC``): the message says what and why."""


class OwnerLock:
    """An open descriptor of a file holding a shared ``flock`` for its owner's lifetime.

    :meth:`close` releases it (closing the descriptor). Descriptors are not inherited by
    programs the owner starts (``O_CLOEXEC``); a forked child shares the lock, which only
    keeps the file alive longer."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def hold(cls, path: Path) -> OwnerLock:
        """Takes the owner lock on an existing file (e.g. a token file kept across restarts)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, Path(path))

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OwnerLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create_locked(path: Path, *, content: bytes = b"", mode: int = 0o600) -> OwnerLock:
    """Creates ``path`` (read-write, ``mode``) holding ``content``, locked before it has that
    name.

    The file is made under a temporary name in the same directory, written, locked, then
    renamed; an existing ``path`` is an error (``FileExistsError``), as with ``O_EXCL``."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}.new")
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        if path.exists():
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        os.rename(staging, path)
    except BaseException:
        os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    return OwnerLock(fd, path)


def create_reserved(path: Path, size: int, *, what: str, hint: str = "") -> OwnerLock:
    """Creates ``path`` locked (:func:`create_locked`) with ``size`` bytes allocated.

    Raises :class:`InsufficientSpace` (the file removed) when the file system has no room,
    with a message naming ``what``, the size, the directory and its free bytes, and ``hint``
    (what the user can do)."""
    directory = Path(path).parent
    free = free_bytes(directory)
    if free is not None and free < size:
        raise InsufficientSpace(_no_room(what, size, directory, free, hint))
    lock = create_locked(path)
    try:
        os.ftruncate(lock.fd, size)
        reserve(lock.fd, size)
    except OSError as exc:
        lock.close()
        Path(path).unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpace(
                _no_room(what, size, directory, free_bytes(directory), hint)
            ) from None
        raise
    except BaseException:
        lock.close()
        Path(path).unlink(missing_ok=True)
        raise
    return lock


def reserve(fd: int, size: int) -> None:
    """Allocates bytes ``[0, size)`` of the open file ``fd`` (``OSError`` ``ENOSPC`` if they do
    not fit). File systems without ``fallocate`` get the holes written with zeros instead;
    content already written is kept."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    zeros = bytes(_ZEROS)
    for offset in range(0, size, _ZEROS):
        length = min(_ZEROS, size - offset)
        if not any(os.pread(fd, length, offset)):
            os.pwrite(fd, zeros[:length], offset)


class ReservedSpace:
    """``nbytes`` of a file system held by a hidden file at ``path`` until :meth:`release`.

    Made at the start of work whose results must be written at its end (a run's summary), so
    that a disk filled meanwhile still has room for them. Where the space cannot be had the
    work goes on without it (logged)."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path: Path | None = Path(path)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                reserve(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot reserve %s in %s for the results: %s", format_bytes(nbytes),
                        self.path.parent, exc)  # fmt: skip

    def release(self) -> None:
        """Frees the space (idempotent)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


OWNED_HEX_DIGITS = 16
"""Hex digits of the random part of the names :func:`owned_name` makes (8: an earlier
version's file, whose owner held no lock)."""


def owned_name(prefix: str, suffix: str = "") -> str:
    """``<prefix><pid>-<16 hex digits><suffix>``: the name of a file this process will own."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(OWNED_HEX_DIGITS // 2)}{suffix}"


def is_owned(path: Path) -> bool:
    """Whether some process holds ``path``'s owner lock (``False`` when it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_if_abandoned(path: Path, legacy_pid: int | None = None) -> bool:
    """Removes ``path`` if no process holds its owner lock; True if it did.

    The exclusive lock is held while the name is removed, and the name must still refer to
    the file that was locked, so a live owner's file is never removed. ``legacy_pid``: the
    file was made by an earlier version whose owner held no lock; it is kept while a process
    with that pid runs here."""
    if legacy_pid is not None and _pid_runs(legacy_pid):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (locked.st_dev, locked.st_ino) != (named.st_dev, named.st_ino):
            return False
        if locked.st_uid != os.getuid():
            return False
        os.unlink(path)
        return True
    except OSError:  # BlockingIOError: held by its owner
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged user may still allocate under ``directory`` (``None``: unknown)."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _no_room(what: str, size: int, directory: Path, free: int | None, hint: str) -> str:
    room = "an unknown amount" if free is None else format_bytes(free)
    message = (
        f"cannot reserve {what} of {format_bytes(size)} ({size} bytes) in {directory}: "
        f"{room} free there"
    )
    return f"{message}; {hint}" if hint else message
