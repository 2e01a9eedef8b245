"""Files a server leaves behind when it cannot clean up (SIGKILL, power loss), and reclaiming them.

A server's pool (``kvtb-pool-<pid>-<hex>``, up to its capacity of RAM in ``/dev/shm``), its
default token file (``kvtb-token-<pid>-<hex>.json``) and a worker's shared KV file
(``kvtb-kv-<pid>-<hex>``, server-driven transfers) carry their process's pid. Each is removed
on every exit its owner can catch; a server start (and ``kvtb clean``) removes those whose pid
no longer runs. Files of live processes, and of other users, are left alone.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import tempfile
from pathlib import Path

_SERVER_FILE = re.compile(r"kvtb-(?:pool|token|kv)-(\d+)-[0-9a-f]+(?:\.json)?")


def server_files_dir() -> Path:
    """Where servers keep their pool and token files: ``/dev/shm`` if it exists."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def default_token_path() -> Path:
    return server_files_dir() / f"kvtb-token-{os.getpid()}-{secrets.token_hex(4)}.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM  # exists, another user's
    return True


def reclaim_dead_server_files(directories: list[Path] | None = None) -> list[Path]:
    """Removes the pool and token files of servers that no longer run; returns them."""
    removed = []
    for directory in directories or [server_files_dir(), Path(tempfile.gettempdir())]:
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            match = _SERVER_FILE.fullmatch(path.name)
            if match is None or pid_alive(int(match.group(1))):
                continue
            try:
                if path.stat().st_uid != os.getuid():
                    continue
                path.unlink()
            except OSError:
                continue
            removed.append(path)
    return removed
